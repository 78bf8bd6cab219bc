//! When a pending record stops waiting: it timed out (on its own side and in
//! the other side's progress), the pending set hit a cap, or the input ended.
//! [`Deadlines`] keeps the order in which a side's records of one VM expire.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::record::UnmatchedReason;

use super::pending::{Guest, Host, Pending, Side};
use super::{JoinEngine, Output};

fn reason<R>(p: &Pending<R>, no_partner: UnmatchedReason) -> UnmatchedReason {
    if p.mismatch {
        UnmatchedReason::MismatchOpSectorLen
    } else {
        no_partner
    }
}

impl JoinEngine {
    /// Emits what of VM `vid` timed out (after the deferred choices that can
    /// be made now).
    pub(super) fn expire_vm(&mut self, vid: u32, out: &mut dyn Output) {
        let v = &self.vms[vid as usize];
        if !v.deferred.is_empty() && v.clock.is_synced() {
            self.resolve_deferred(vid, false, out);
        }
        self.expire_side::<Guest>(vid, out);
        self.expire_side::<Host>(vid, out);
    }

    /// Emits the records of side `S` of VM `vid` that are `timeout_ns` old on
    /// their own side and that the other side has progressed `timeout_ns`
    /// past since they arrived (or that the other side never sent anything for).
    fn expire_side<S: Side>(&mut self, vid: u32, out: &mut dyn Output) {
        let timeout = self.cfg.timeout_ns;
        loop {
            let (own, other) = S::split(&mut self.sides);
            // Nothing is due before the earliest entry, live or not (records
            // leaving drop the stale ones at the front): most calls end here.
            if !own.due(vid) {
                break;
            }
            let Some((deadline, id)) = own.next_deadline(vid) else {
                break;
            };
            // (the earliest live entry may be later than the stale one seen)
            if own.vm(vid).now.is_none_or(|n| n < deadline) {
                break;
            }
            let o = other.vm(vid);
            let other_done = match o.now {
                None => true,
                Some(now) => {
                    let at = own
                        .get(id)
                        .and_then(|p| p.other_at_arrival)
                        .or(o.first)
                        .unwrap_or(0);
                    now >= at.saturating_add(timeout)
                }
            };
            if !other_done {
                break;
            }
            if !self.vms[vid as usize].deferred.is_empty() {
                // Nothing expires while a deferred choice could still take it.
                self.resolve_deferred(vid, true, out);
                continue;
            }
            S::set_mut(&mut self.sides).pop_deadline(vid);
            if let Some(p) = self.take::<S>(id) {
                let r = reason(&p, S::NO_PARTNER);
                self.unmatched::<S>(p, r, out);
            }
        }
    }

    /// Evicts the oldest pending record of side `S` of VM `vid` (only that VM's).
    pub(super) fn evict<S: Side>(&mut self, vid: u32, out: &mut dyn Output) {
        let set = S::set_mut(&mut self.sides);
        let Some((_, id)) = set.next_deadline(vid) else {
            return;
        };
        set.pop_deadline(vid);
        if let Some(p) = self.take::<S>(id) {
            self.stats.evicted += 1;
            self.unmatched::<S>(p, UnmatchedReason::Evicted, out);
        }
    }

    /// Emits the pending records of side `S`, oldest first.
    pub(super) fn drain<S: Side>(&mut self, out: &mut dyn Output) {
        for id in S::set(&self.sides).ids_by_last() {
            if let Some(p) = self.take::<S>(id) {
                let r = reason(&p, S::NO_PARTNER);
                self.unmatched::<S>(p, r, out);
            }
        }
        S::set_mut(&mut self.sides).clear_deadlines();
    }
}

/// An expiry entry `(deadline, id, generation)`.
pub(super) type Deadline = (u64, u32, u32);

/// The expiry entries of one side of one VM, earliest first (ties by id and
/// generation): the order of one binary heap, at a lower cost. Records
/// arrive nearly in deadline order, so an entry not earlier than the newest
/// in-order one goes to the back of a FIFO (O(1)); the few that arrive out of
/// order wait in a heap (O(log n), as before, also for a hostile stream).
#[derive(Default)]
pub(super) struct Deadlines {
    fifo: VecDeque<Deadline>,
    late: BinaryHeap<Reverse<Deadline>>,
}

impl Deadlines {
    pub fn push(&mut self, d: Deadline) {
        match self.fifo.back() {
            Some(&back) if d < back => self.late.push(Reverse(d)),
            _ => self.fifo.push_back(d),
        }
    }

    /// The earliest entry.
    pub fn peek(&self) -> Option<Deadline> {
        match (self.fifo.front(), self.late.peek()) {
            (Some(&f), Some(&Reverse(l))) => Some(f.min(l)),
            (f, l) => f.copied().or(l.map(|r| r.0)),
        }
    }

    /// Drops the earliest entry.
    pub fn pop(&mut self) {
        let Some(d) = self.peek() else {
            return;
        };
        if self.fifo.front() == Some(&d) {
            self.fifo.pop_front();
        } else {
            self.late.pop();
        }
    }

    pub fn len(&self) -> usize {
        self.fifo.len() + self.late.len()
    }

    pub fn clear(&mut self) {
        self.fifo.clear();
        self.late.clear();
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&Deadline) -> bool) {
        self.fifo.retain(|d| keep(d));
        self.late.retain(|Reverse(d)| keep(d));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same order as one min-heap, whatever the arrival order.
    #[test]
    fn deadlines_pop_in_heap_order() {
        let mut rng = super::super::synth::Rng(3);
        let mut d = Deadlines::default();
        let mut heap = BinaryHeap::new();
        for i in 0..5000u32 {
            // Mostly in order, some late, some far early; pops interleaved.
            let t = match rng.below(10) {
                0 => rng.below(1000 * i as u64 + 1),
                1 => 1000 * i as u64 + 50_000,
                _ => 1000 * i as u64 + rng.below(3000),
            };
            let e = (t, i % 7, i);
            d.push(e);
            heap.push(Reverse(e));
            if rng.below(3) == 0 {
                assert_eq!(d.peek(), heap.peek().map(|r| r.0));
                d.pop();
                heap.pop();
            }
            assert_eq!(d.len(), heap.len());
        }
        d.retain(|e| e.2 % 2 == 0);
        heap.retain(|Reverse(e)| e.2 % 2 == 0);
        while let Some(Reverse(e)) = heap.pop() {
            assert_eq!(d.peek(), Some(e));
            d.pop();
        }
        assert_eq!((d.peek(), d.len()), (None, 0));
    }
}
