//! When a pending record stops waiting: it timed out (on its own side and in
//! the other side's progress), the pending set hit a cap, or the input ended.

use crate::record::{JoinedIo, UnmatchedReason};

use super::pending::{Guest, Host, Pending, Side};
use super::JoinEngine;

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
    pub(super) fn expire_vm(&mut self, vid: u32, out: &mut Vec<JoinedIo>) {
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
    fn expire_side<S: Side>(&mut self, vid: u32, out: &mut Vec<JoinedIo>) {
        let timeout = self.cfg.timeout_ns;
        loop {
            let (own, other) = S::split(&mut self.sides);
            let Some((deadline, id)) = own.next_deadline(vid) else {
                break;
            };
            let own_done = own.vm(vid).now.is_some_and(|n| n >= deadline);
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
            if !(own_done && other_done) {
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
    pub(super) fn evict<S: Side>(&mut self, vid: u32, out: &mut Vec<JoinedIo>) {
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

    /// Emits the pending records of side `S`, oldest first, until `out` holds
    /// `max`; true when none is left.
    pub(super) fn drain<S: Side>(&mut self, out: &mut Vec<JoinedIo>, max: usize) -> bool {
        for id in S::set(&self.sides).ids_by_last() {
            if out.len() >= max {
                return false;
            }
            if let Some(p) = self.take::<S>(id) {
                let r = reason(&p, S::NO_PARTNER);
                self.unmatched::<S>(p, r, out);
            }
        }
        S::set_mut(&mut self.sides).clear_deadlines();
        true
    }
}
