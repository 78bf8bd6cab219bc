//! The pending records of one side, written once for both sides.
//!
//! [`Side`] says what differs between a guest request and a host element (its
//! record type, which points bound it, how it is indexed, what its list order
//! is); [`PendingSet`] keeps the records of one side that wait for a partner:
//! a generational slab, the `(vm, queue, head)` and `(vm, sector)` indexes and,
//! per VM, the side's progress and its expiry order.

use std::collections::VecDeque;
use std::marker::PhantomData;

use crate::clock::OffsetEstimate;
use crate::record::{GuestRq, Point, Points, UnmatchedReason};

use super::emit::Parts;
use super::expiry::Deadlines;
use super::host_entry::HostEntry;
use super::matching::{ended_too_late, submitted_too_late};

type FxMap<K, V> = rustc_hash::FxHashMap<K, V>;

/// The causal points of a record: when it started and ended on its side,
/// and its first and last point.
#[derive(Clone, Copy, Debug)]
pub(super) struct Times {
    /// Guest: the latest submission point (the request is on the avail ring
    /// after it). Host: the first point of the element's processing.
    pub start: Option<u64>,
    /// Guest: the first completion point. Host: the element's push (or the
    /// backend's completion).
    pub end: Option<u64>,
    pub first: u64,
    pub last: u64,
}

impl Times {
    pub fn of<S: Side>(ts: &Points) -> Self {
        let first_of = |pts: &[Point]| pts.iter().find_map(|p| ts.get(*p));
        let (first, last) = ts.min_max().unwrap_or((0, 0));
        Times {
            start: first_of(S::START),
            end: first_of(S::END),
            first,
            last,
        }
    }

    /// The guest time at which a guest record's clock mapping is taken.
    pub fn anchor(&self) -> u64 {
        self.start.or(self.end).unwrap_or(self.last)
    }
}

/// One pending record.
pub(super) struct Pending<R> {
    pub vm: u32,
    pub rec: R,
    pub t: Times,
    /// The other side's progress for this VM when the record arrived.
    pub other_at_arrival: Option<u64>,
    /// A partner failed only on op/sector/length.
    pub mismatch: bool,
}

/// What differs between the guest side and the host side.
pub(super) trait Side: Sized + 'static {
    type Rec: Clone;
    type Other: Side<Other = Self>;
    const IS_GUEST: bool;
    /// Start and end points, in order of preference.
    const START: &'static [Point];
    const END: &'static [Point];
    /// Why a record of this side is emitted alone when no partner came.
    const NO_PARTNER: UnmatchedReason;
    /// Whether this side's sector index holds only records without a head
    /// (guest) rather than every record of a headless VM (host).
    const SECTOR_INDEX_HEADLESS_ONLY: bool;

    /// The record's points.
    fn points(r: &Self::Rec) -> Points;
    fn sector(r: &Self::Rec) -> u64;
    /// `(queue, head)` when the record has both.
    fn queue_head(r: &Self::Rec) -> Option<(u16, u16)>;
    /// The order of this side's index lists (see [`insert_sorted`]).
    fn sort_key(t: &Times) -> u64;
    /// Tie-break among candidates of this side when there is no clock.
    fn age(t: &Times) -> u64;
    /// Whether a candidate of this side, and every later one in its sorted
    /// list, is too late for the given pair (`g`, `h`) under `est`.
    fn beyond(g: &Times, h: &Times, est: Option<OffsetEstimate>, slack: u64) -> bool;
    /// Orders a pair of values of (this side, the other side) as (guest, host).
    fn guest_first<T>(mine: T, theirs: T) -> (T, T);
    fn refs<'a>(
        mine: &'a Self::Rec,
        theirs: &'a <Self::Other as Side>::Rec,
    ) -> (&'a GuestRq, &'a HostEntry);
    fn alone(r: &Self::Rec) -> Parts<'_>;
    fn set(s: &Sides) -> &PendingSet<Self>;
    fn set_mut(s: &mut Sides) -> &mut PendingSet<Self>;
    fn split(s: &mut Sides) -> (&mut PendingSet<Self>, &mut PendingSet<Self::Other>);
}

pub(super) struct Guest;
pub(super) struct Host;

impl Side for Guest {
    type Rec = GuestRq;
    type Other = Host;
    const IS_GUEST: bool = true;
    /// Guest points that precede the avail-ring publication, latest first
    /// (`g.rq_issue` fires inside `queue_rq`, after `g.queue_rq`).
    const START: &'static [Point] = &[
        Point::VqAdd,
        Point::RqIssue,
        Point::QueueRq,
        Point::RqInsert,
        Point::BioQueue,
    ];
    const END: &'static [Point] = &[Point::RqComplete, Point::BioComplete, Point::DriverComplete];
    const NO_PARTNER: UnmatchedReason = UnmatchedReason::NoHostRecord;
    const SECTOR_INDEX_HEADLESS_ONLY: bool = true;

    fn points(r: &GuestRq) -> Points {
        r.ts.clone()
    }
    fn sector(r: &GuestRq) -> u64 {
        r.sector
    }
    fn queue_head(r: &GuestRq) -> Option<(u16, u16)> {
        r.queue.zip(r.head)
    }
    fn sort_key(t: &Times) -> u64 {
        t.start.unwrap_or(t.last)
    }
    fn age(t: &Times) -> u64 {
        Self::sort_key(t)
    }
    fn beyond(g: &Times, h: &Times, est: Option<OffsetEstimate>, slack: u64) -> bool {
        submitted_too_late(g, h, est, slack)
    }
    fn guest_first<T>(mine: T, theirs: T) -> (T, T) {
        (mine, theirs)
    }
    fn refs<'a>(mine: &'a GuestRq, theirs: &'a HostEntry) -> (&'a GuestRq, &'a HostEntry) {
        (mine, theirs)
    }
    fn alone(r: &GuestRq) -> Parts<'_> {
        Parts::Guest(r)
    }
    fn set(s: &Sides) -> &PendingSet<Self> {
        &s.guest
    }
    fn set_mut(s: &mut Sides) -> &mut PendingSet<Self> {
        &mut s.guest
    }
    fn split(s: &mut Sides) -> (&mut PendingSet<Self>, &mut PendingSet<Host>) {
        (&mut s.guest, &mut s.host)
    }
}

impl Side for Host {
    type Rec = HostEntry;
    type Other = Guest;
    const IS_GUEST: bool = false;
    const START: &'static [Point] = &[Point::HostPop, Point::HostSubmit, Point::HostIoIssue];
    const END: &'static [Point] = &[
        Point::HostPush,
        Point::HostCompleteCb,
        Point::HostIoComplete,
    ];
    const NO_PARTNER: UnmatchedReason = UnmatchedReason::NoGuestRecord;
    const SECTOR_INDEX_HEADLESS_ONLY: bool = false;

    fn points(r: &HostEntry) -> Points {
        r.points()
    }
    fn sector(r: &HostEntry) -> u64 {
        r.sector
    }
    fn queue_head(r: &HostEntry) -> Option<(u16, u16)> {
        Some((r.queue, r.head))
    }
    fn sort_key(t: &Times) -> u64 {
        t.end.unwrap_or(t.last)
    }
    fn age(t: &Times) -> u64 {
        t.first
    }
    fn beyond(g: &Times, h: &Times, est: Option<OffsetEstimate>, slack: u64) -> bool {
        ended_too_late(g, h, est, slack)
    }
    fn guest_first<T>(mine: T, theirs: T) -> (T, T) {
        (theirs, mine)
    }
    fn refs<'a>(mine: &'a HostEntry, theirs: &'a GuestRq) -> (&'a GuestRq, &'a HostEntry) {
        (theirs, mine)
    }
    fn alone(r: &HostEntry) -> Parts<'_> {
        Parts::Host(r)
    }
    fn set(s: &Sides) -> &PendingSet<Self> {
        &s.host
    }
    fn set_mut(s: &mut Sides) -> &mut PendingSet<Self> {
        &mut s.host
    }
    fn split(s: &mut Sides) -> (&mut PendingSet<Self>, &mut PendingSet<Guest>) {
        (&mut s.host, &mut s.guest)
    }
}

/// Both sides' pending sets.
pub(super) struct Sides {
    pub guest: PendingSet<Guest>,
    pub host: PendingSet<Host>,
}

impl Sides {
    pub fn new() -> Self {
        Sides {
            guest: PendingSet::new(),
            host: PendingSet::new(),
        }
    }
}

/// One side's state for one VM.
#[derive(Default)]
pub(super) struct SideVm {
    /// The side's newest point for this VM (its progress), and its first.
    pub now: Option<u64>,
    pub first: Option<u64>,
    /// Expiry entries of this VM's records on this side.
    pub deadlines: Deadlines,
    /// Live pending records of this VM on this side.
    pub pending: usize,
}

impl SideVm {
    pub fn observe(&mut self, first: u64, last: u64) {
        self.now = Some(self.now.map_or(last, |n| n.max(last)));
        self.first.get_or_insert(first);
    }
}

/// The pending records of one side.
pub(super) struct PendingSet<S: Side> {
    slab: Slab<Pending<S::Rec>>,
    by_head: FxMap<u64, VecDeque<u32>>,
    by_sector: FxMap<(u32, u64), VecDeque<u32>>,
    vms: Vec<SideVm>,
    side: PhantomData<S>,
}

pub(super) fn head_key(vm: u32, (queue, head): (u16, u16)) -> u64 {
    ((vm as u64) << 32) | ((queue as u64) << 16) | head as u64
}

impl<S: Side> PendingSet<S> {
    fn new() -> Self {
        PendingSet {
            slab: Slab::new(),
            by_head: FxMap::default(),
            by_sector: FxMap::default(),
            vms: Vec::new(),
            side: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.slab.len
    }

    pub fn add_vm(&mut self) {
        self.vms.push(SideVm::default());
    }

    pub fn vm(&self, vm: u32) -> &SideVm {
        &self.vms[vm as usize]
    }

    pub fn vm_mut(&mut self, vm: u32) -> &mut SideVm {
        &mut self.vms[vm as usize]
    }

    pub fn get(&self, id: u32) -> Option<&Pending<S::Rec>> {
        self.slab.get(id)
    }

    pub fn get_mut(&mut self, id: u32) -> Option<&mut Pending<S::Rec>> {
        self.slab.get_mut(id)
    }

    pub fn live(&self, id: u32, gen: u32) -> bool {
        self.slab.live(id, gen)
    }

    /// Ids of the live records, oldest last point first.
    pub fn ids_by_last(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..self.slab.items.len() as u32)
            .filter(|&i| self.slab.get(i).is_some())
            .collect();
        ids.sort_by_key(|&i| self.slab.get(i).map(|p| p.t.last));
        ids
    }

    /// The index lists that may hold a partner for a record of the other
    /// side with head key `key` and `sector`: by head, then (for a record
    /// without a head, or among headless guest records) by sector.
    pub fn candidates(
        &self,
        vm: u32,
        key: Option<u64>,
        sector: u64,
        headless: bool,
    ) -> [Option<&VecDeque<u32>>; 2] {
        let by_head = key.and_then(|k| self.by_head.get(&k));
        let by_sector = if key.is_none() || (S::SECTOR_INDEX_HEADLESS_ONLY && headless) {
            self.by_sector.get(&(vm, sector))
        } else {
            None
        };
        [by_head, by_sector]
    }

    /// Whether a record belongs in the sector index.
    fn sector_indexed(key: Option<u64>, headless: bool) -> bool {
        key.is_none() || (!S::SECTOR_INDEX_HEADLESS_ONLY && headless)
    }

    /// Adds a record with its indexes and expiry deadline; `(id, generation)`.
    pub fn insert(&mut self, p: Pending<S::Rec>, headless: bool, timeout_ns: u64) -> (u32, u32) {
        let vm = p.vm;
        let key = S::queue_head(&p.rec).map(|qh| head_key(vm, qh));
        let sector = S::sector(&p.rec);
        let deadline = p.t.last.saturating_add(timeout_ns);
        let (id, gen) = self.slab.insert(p);
        let slab = &self.slab;
        let key_of = |x: u32| slab.get(x).map(|p| S::sort_key(&p.t));
        if let Some(k) = key {
            insert_sorted(self.by_head.entry(k).or_default(), id, key_of);
        }
        if Self::sector_indexed(key, headless) {
            insert_sorted(self.by_sector.entry((vm, sector)).or_default(), id, key_of);
        }
        let v = &mut self.vms[vm as usize];
        v.pending += 1;
        v.deadlines.push((deadline, id, gen));
        // Matched records leave stale expiry entries until their deadline;
        // if time stalls, drop them so memory stays bounded by the cap.
        if v.deadlines.len() > 4 * slab.len + 4096 {
            v.deadlines.retain(|&(_, id, gen)| slab.live(id, gen));
        }
        (id, gen)
    }

    /// Removes a live record from the set and its indexes.
    pub fn remove(&mut self, id: u32, headless: bool) -> Option<Pending<S::Rec>> {
        let vm = self.unindex(id, headless)?;
        let p = self.slab.remove(id);
        self.drop_stale_deadlines(vm);
        p
    }

    /// Removes a live record and drops it in place (its output was built
    /// from it where it was); whether it was live.
    pub fn discard(&mut self, id: u32, headless: bool) -> bool {
        let Some(vm) = self.unindex(id, headless) else {
            return false;
        };
        let done = self.slab.discard(id);
        self.drop_stale_deadlines(vm);
        done
    }

    /// Drops the expiry entries at the front of a VM's order whose records
    /// have left (the slab's generations tell, not the records): records
    /// mostly leave in the order they came, so the order stays about as long
    /// as the VM's pending set, and its front is live when expiry looks.
    fn drop_stale_deadlines(&mut self, vm: u32) {
        let v = &mut self.vms[vm as usize];
        while let Some((_, id, gen)) = v.deadlines.peek() {
            if self.slab.live(id, gen) {
                break;
            }
            v.deadlines.pop();
        }
    }

    /// Whether the earliest expiry entry of a VM (live or not) is due on this
    /// side's own clock: when it is not, no live entry is either.
    pub fn due(&self, vm: u32) -> bool {
        let v = &self.vms[vm as usize];
        match (v.deadlines.peek(), v.now) {
            (Some((deadline, _, _)), Some(now)) => now >= deadline,
            _ => false,
        }
    }

    /// Takes a live record out of its VM's count and its indexes; its VM.
    fn unindex(&mut self, id: u32, headless: bool) -> Option<u32> {
        let p = self.slab.get(id)?;
        let (vm, sector) = (p.vm, S::sector(&p.rec));
        let key = S::queue_head(&p.rec).map(|qh| head_key(vm, qh));
        let v = &mut self.vms[vm as usize];
        v.pending = v.pending.saturating_sub(1);
        if let Some(l) = key.and_then(|k| self.by_head.get_mut(&k)) {
            remove_id(l, id);
        }
        if Self::sector_indexed(key, headless) {
            let sk = (vm, sector);
            if let Some(l) = self.by_sector.get_mut(&sk) {
                remove_id(l, id);
                if l.is_empty() {
                    self.by_sector.remove(&sk);
                }
            }
        }
        Some(vm)
    }

    /// Indexes every pending record of `vm` by sector (the VM turned out to
    /// have guest records without a head).
    pub fn index_by_sector(&mut self, vm: u32) {
        for (id, s) in self.slab.items.iter().enumerate() {
            if let Some(p) = s.as_ref().filter(|p| p.vm == vm) {
                let slab = &self.slab;
                insert_sorted(
                    self.by_sector.entry((vm, S::sector(&p.rec))).or_default(),
                    id as u32,
                    |x| slab.get(x).map(|p| S::sort_key(&p.t)),
                );
            }
        }
    }

    /// The earliest expiry entry of a VM that is still live `(deadline, id)`
    /// (stale entries are dropped on the way).
    pub fn next_deadline(&mut self, vm: u32) -> Option<(u64, u32)> {
        let v = &mut self.vms[vm as usize];
        while let Some((deadline, id, gen)) = v.deadlines.peek() {
            if self.slab.live(id, gen) {
                return Some((deadline, id));
            }
            v.deadlines.pop();
        }
        None
    }

    /// Drops the earliest expiry entry of a VM.
    pub fn pop_deadline(&mut self, vm: u32) {
        self.vms[vm as usize].deadlines.pop();
    }

    /// Drops every expiry entry (all records are being emitted).
    pub fn clear_deadlines(&mut self) {
        for v in &mut self.vms {
            v.deadlines.clear();
        }
    }

    /// The VM with the most pending records on this side.
    pub fn fullest_vm(&self) -> u32 {
        (0..self.vms.len() as u32)
            .max_by_key(|&i| self.vms[i as usize].pending)
            .unwrap_or(0)
    }
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

/// A slab with generations: `(id, gen)` names one record even after its id is
/// reused. The generations are kept apart from the records, odd while the slot
/// holds one: whether an expiry entry is still live is read from this compact
/// array, not from the record (most entries are of records already joined).
struct Slab<T> {
    items: Vec<Option<T>>,
    gens: Vec<u32>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Slab<T> {
    fn new() -> Self {
        Slab {
            items: Vec::new(),
            gens: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
    fn insert(&mut self, v: T) -> (u32, u32) {
        self.len += 1;
        if let Some(id) = self.free.pop() {
            let g = &mut self.gens[id as usize];
            *g = g.wrapping_add(1);
            self.items[id as usize] = Some(v);
            (id, *g)
        } else {
            self.items.push(Some(v));
            self.gens.push(1);
            ((self.items.len() - 1) as u32, 1)
        }
    }
    fn get(&self, id: u32) -> Option<&T> {
        self.items.get(id as usize).and_then(Option::as_ref)
    }
    fn get_mut(&mut self, id: u32) -> Option<&mut T> {
        self.items.get_mut(id as usize).and_then(Option::as_mut)
    }
    /// Whether `id` still holds the record given `gen` (odd) when inserted.
    fn live(&self, id: u32, gen: u32) -> bool {
        self.gens.get(id as usize) == Some(&gen)
    }
    fn remove(&mut self, id: u32) -> Option<T> {
        let v = self.items.get_mut(id as usize)?.take()?;
        self.freed(id);
        Some(v)
    }
    /// [`remove`](Self::remove) without moving the value out.
    fn discard(&mut self, id: u32) -> bool {
        let Some(s) = self.items.get_mut(id as usize).filter(|s| s.is_some()) else {
            return false;
        };
        *s = None;
        self.freed(id);
        true
    }
    fn freed(&mut self, id: u32) {
        let g = &mut self.gens[id as usize];
        *g = g.wrapping_add(1);
        self.free.push(id);
        self.len -= 1;
    }
}
