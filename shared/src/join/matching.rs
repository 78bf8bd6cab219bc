//! Finding a record's partner among the other side's pending records, and
//! what happens to a record that has none yet (it waits, possibly with its
//! choice deferred until the VM has a clock).

use std::borrow::Cow;

use crate::clock::OffsetEstimate;
use crate::record::{GuestRq, Name, Op};

use super::emit::{make_joined, JoinCtx};
use super::host_entry::HostEntry;
use super::pending::{head_key, Guest, Host, Pending, Side, Times};
use super::{JoinEngine, Output};

/// The outcome of a partner search.
#[derive(Default)]
pub(super) struct Found {
    /// The best candidate and the clock estimate at its guest record.
    pub best: Option<(u32, Option<OffsetEstimate>)>,
    /// How many candidates passed every check.
    pub valid: usize,
    /// Candidates that failed only on op/sector/length.
    pub mismatched: Vec<u32>,
}

fn ops_compatible(g: Op, h: Op) -> bool {
    g == h || (g == Op::Other && h == Op::GetId)
}

/// Op, sector and length agree (sector/length only for reads and writes:
/// virtio-blk carries discard/write-zeroes ranges in the payload and flushes
/// have none).
fn confirm(g: &GuestRq, h: &HostEntry) -> bool {
    if !ops_compatible(g.op, h.op) {
        return false;
    }
    match g.op {
        Op::Read | Op::Write => g.sector == h.sector && g.bytes == h.bytes,
        _ => true,
    }
}

/// Is there a θ consistent with the estimate and with causality?
fn time_ok(g: &Times, h: &Times, est: Option<OffsetEstimate>, slack: u64) -> bool {
    let slack = slack as i128;
    let (mut lo, mut hi) = match est {
        Some(e) => (e.lo() as i128 - slack, e.hi() as i128 + slack),
        None => (i128::MIN, i128::MAX),
    };
    if let (Some(s), Some(p)) = (g.start, h.start) {
        hi = hi.min(p as i128 - s as i128 + slack);
    }
    if let (Some(d), Some(u)) = (g.end, h.end) {
        lo = lo.max(u as i128 - d as i128 - slack);
    }
    lo <= hi
}

/// The host element ended too late for the guest request (`θ ≥ end − done >
/// hi`); host lists are sorted by end, so every later element did too.
pub(super) fn ended_too_late(
    g: &Times,
    h: &Times,
    est: Option<OffsetEstimate>,
    slack: u64,
) -> bool {
    match (est, g.end, h.end) {
        (Some(e), Some(d), Some(he)) => {
            he as i128 - d as i128 - slack as i128 > e.hi() as i128 + slack as i128
        }
        _ => false,
    }
}

/// The guest request was submitted too late for the host element (`θ ≤
/// start − sub < lo`); guest lists are sorted by submission, so every later
/// request was too.
pub(super) fn submitted_too_late(
    g: &Times,
    h: &Times,
    est: Option<OffsetEstimate>,
    slack: u64,
) -> bool {
    match (est, g.start, h.start) {
        (Some(e), Some(gs), Some(hs)) => {
            (hs as i128 - gs as i128 + slack as i128) < e.lo() as i128 - slack as i128
        }
        _ => false,
    }
}

/// Distance used to rank candidates that pass [`time_ok`]: how far the host
/// midpoint is from the mapped guest midpoint.
fn score(g: &Times, h: &Times, est: Option<OffsetEstimate>, fallback: u64) -> u128 {
    match (mid(g), mid(h), est) {
        (Some(g), Some(h), Some(e)) => (g as i128 + e.offset_ns as i128 - h as i128).unsigned_abs(),
        _ => fallback as u128,
    }
}

fn mid(t: &Times) -> Option<u64> {
    match (t.start, t.end) {
        (Some(a), Some(b)) => Some(a / 2 + b / 2 + (a % 2 + b % 2) / 2),
        (x, None) | (None, x) => x,
    }
}

/// Whether a guest disk and a host device may be the same disk, given the
/// pairs learned from earlier joins.
fn binding_ok(bindings: &[(Name, Name)], disk: &str, device: &str) -> bool {
    bindings
        .iter()
        .all(|(d, dev)| (d == disk) == (dev == device))
}

impl JoinEngine {
    /// The best pending record of the other side for `rec` (of side `S`).
    fn find<S: Side>(&mut self, vid: u32, rec: &S::Rec, t: &Times) -> Found {
        let slack = self.cfg.slack_ns;
        let v = &mut self.vms[vid as usize];
        let (clock, bindings) = (&mut v.clock, &v.bindings);
        let synced = clock.is_synced();
        let mut est_at = |g: &Times| {
            if synced {
                clock.offset_at(g.anchor())
            } else {
                None
            }
        };
        // A guest record's own estimate serves every candidate.
        let mine = S::IS_GUEST.then(|| est_at(t));
        let key = S::queue_head(rec).map(|qh| head_key(vid, qh));
        let others = <S::Other as Side>::set(&self.sides);
        let mut found = Found::default();
        let mut best: Option<(u128, u32, Option<OffsetEstimate>)> = None;
        // Each list is sorted so that once a candidate is too late, every
        // later one in that list is too.
        let lists = others.candidates(vid, key, S::sector(rec), v.headless);
        for list in lists.into_iter().flatten() {
            for &id in list {
                let Some(c) = others.get(id) else {
                    continue;
                };
                let (g, h) = S::refs(rec, &c.rec);
                if c.vm != vid || g.queue.is_some_and(|q| q != h.queue) {
                    continue;
                }
                let (gt, ht) = S::guest_first(t, &c.t);
                let est = match mine {
                    Some(e) => e,
                    None => est_at(gt),
                };
                // (The list's order, not the candidate's disk, makes every
                // later one too late as well.)
                if <S::Other as Side>::beyond(gt, ht, est, slack) {
                    break;
                }
                // The names are compared only for a candidate in time (most
                // of a reused head's list is not).
                if !time_ok(gt, ht, est, slack) || !binding_ok(bindings, &g.disk, &h.device) {
                    continue;
                }
                if !confirm(g, h) {
                    found.mismatched.push(id);
                    continue;
                }
                found.valid += 1;
                let sc = score(gt, ht, est, <S::Other as Side>::age(&c.t));
                if best.is_none_or(|(b, _, _)| sc < b) {
                    best = Some((sc, id, est));
                }
            }
        }
        found.best = best.map(|(_, id, est)| (id, est));
        found
    }

    /// Adds a record of side `S` from VM `vid`: joins it with its partner,
    /// or keeps it pending; then emits what of the VM expired. A borrowed
    /// record is copied only if it has to wait (a guest record mostly finds
    /// its host element already there, and is read in place). `t`: its times.
    pub(super) fn push<S: Side>(
        &mut self,
        vid: u32,
        rec: Cow<'_, S::Rec>,
        t: Times,
        out: &mut dyn Output,
    ) {
        S::set_mut(&mut self.sides)
            .vm_mut(vid)
            .observe(t.first, t.last);
        if S::queue_head(&rec).is_none() {
            self.enable_headless(vid);
        }
        let found = self.find::<S>(vid, &rec, &t);
        let defer = found.valid > 1 && !self.vms[vid as usize].clock.is_synced();
        let joined = match (found.best, defer) {
            (Some((id, est)), false) => {
                self.join_pending::<S>(vid, (&rec, &t), id, est, found.valid == 1, out)
            }
            _ => false,
        };
        if !joined {
            self.wait::<S>(vid, rec.into_owned(), t, found, defer, out);
        }
        self.expire_vm(vid, out);
    }

    /// Joins a record of side `S` with the other side's pending record `id`
    /// (read in place, then dropped); false when that one is not pending.
    fn join_pending<S: Side>(
        &mut self,
        vid: u32,
        (rec, t): (&S::Rec, &Times),
        id: u32,
        est: Option<OffsetEstimate>,
        unambiguous: bool,
        out: &mut dyn Output,
    ) -> bool {
        let others = <S::Other as Side>::set(&self.sides);
        let Some(p) = others.get(id) else {
            return false;
        };
        let vm = p.vm;
        let (g, h) = S::refs(rec, &p.rec);
        let (gt, ht) = S::guest_first(t, &p.t);
        let cx = JoinCtx {
            vm: &mut self.vms[vid as usize],
            stats: &mut self.stats,
            max_drift_ppm: self.cfg.clock.max_drift_ppm,
        };
        make_joined(cx, (g, gt), (h, ht), est, unambiguous, out);
        let headless = self.vms[vm as usize].headless;
        <S::Other as Side>::set_mut(&mut self.sides).discard(id, headless)
    }

    /// Keeps a record without a partner pending (evicting first if a cap is reached).
    fn wait<S: Side>(
        &mut self,
        vid: u32,
        rec: S::Rec,
        t: Times,
        found: Found,
        defer: bool,
        out: &mut dyn Output,
    ) {
        let (own, other) = S::split(&mut self.sides);
        for &id in &found.mismatched {
            if let Some(p) = other.get_mut(id) {
                p.mismatch = true;
            }
        }
        // The other side's progress when this record arrived, but at least this
        // record's own end mapped into the other side's clock: after an
        // interrupted stream the other side's progress is stale, and its resent
        // records still have to reach this record's time.
        let mapped = {
            let clock = &mut self.vms[vid as usize].clock;
            if !clock.is_synced() {
                None
            } else if S::IS_GUEST {
                clock
                    .offset_at(t.last)
                    .map(|e| t.last.saturating_add_signed(e.offset_ns))
            } else {
                let near = other.vm(vid).now.unwrap_or(t.last);
                clock
                    .offset_at(near)
                    .map(|e| t.last.saturating_add_signed(-e.offset_ns))
            }
        };
        let other_at_arrival = match (other.vm(vid).now, mapped) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let full = if own.vm(vid).pending >= self.cfg.max_pending_per_vm {
            Some(vid)
        } else if own.len() >= self.cfg.max_pending {
            // The VM with the most pending records loses its oldest.
            Some(own.fullest_vm())
        } else {
            None
        };
        if let Some(vm) = full {
            self.evict::<S>(vm, out);
        }
        let p = Pending {
            vm: vid,
            rec,
            t,
            other_at_arrival,
            mismatch: !found.mismatched.is_empty(),
        };
        let headless = self.vms[vid as usize].headless;
        let (id, gen) = S::set_mut(&mut self.sides).insert(p, headless, self.cfg.timeout_ns);
        if defer {
            self.defer(vid, S::IS_GUEST, id, gen);
        }
    }

    /// Removes a live pending record of side `S` from its set.
    pub(super) fn take<S: Side>(&mut self, id: u32) -> Option<Pending<S::Rec>> {
        let set = S::set_mut(&mut self.sides);
        let vm = set.get(id)?.vm;
        set.remove(id, self.vms[vm as usize].headless)
    }

    /// The VM has guest records without a head: from now on its host
    /// elements are indexed by sector too.
    fn enable_headless(&mut self, vid: u32) {
        let v = &mut self.vms[vid as usize];
        if !v.headless {
            v.headless = true;
            self.sides.host.index_by_sector(vid);
        }
    }

    fn defer(&mut self, vid: u32, is_guest: bool, id: u32, gen: u32) {
        let (guests, hosts) = (&self.sides.guest, &self.sides.host);
        let d = &mut self.vms[vid as usize].deferred;
        d.push((is_guest, id, gen));
        // Entries of records joined meanwhile are stale: keep the list bounded.
        if d.len() > 2 * (guests.len() + hosts.len()) + 64 {
            d.retain(|&(g, id, gen)| {
                if g {
                    guests.live(id, gen)
                } else {
                    hosts.live(id, gen)
                }
            });
        }
    }

    /// Joins the records whose choice was deferred: they had several valid
    /// partners while the VM had no clock sample, where the only tie-break
    /// would be arrival order (wrong when the older partner's own record is
    /// merely late). Called once the clock is synced, or with `fallback`
    /// before anything of the VM expires and at flush (then the oldest
    /// candidate wins, as a last resort).
    pub(super) fn resolve_deferred(&mut self, vid: u32, fallback: bool, out: &mut dyn Output) {
        let mut deferred = std::mem::take(&mut self.vms[vid as usize].deferred);
        // Oldest first on each side (guests, then hosts): a head is reused in
        // order, so without a clock the oldest request takes the oldest element.
        let (guests, hosts) = (&self.sides.guest, &self.sides.host);
        deferred.sort_by_key(|&(g, id, _)| {
            let t = if g {
                guests.get(id).map(|p| Guest::sort_key(&p.t))
            } else {
                hosts.get(id).map(|p| Host::sort_key(&p.t))
            };
            (!g, t)
        });
        for (is_guest, id, gen) in deferred {
            if is_guest {
                self.retry::<Guest>(vid, id, gen, fallback, out);
            } else {
                self.retry::<Host>(vid, id, gen, fallback, out);
            }
        }
    }

    /// Searches again for the partner of a deferred record.
    fn retry<S: Side>(
        &mut self,
        vid: u32,
        id: u32,
        gen: u32,
        fallback: bool,
        out: &mut dyn Output,
    ) {
        let set = S::set(&self.sides);
        let Some(p) = set.get(id).filter(|_| set.live(id, gen)) else {
            return;
        };
        let (rec, t) = (p.rec.clone(), p.t);
        let found = self.find::<S>(vid, &rec, &t);
        let Some((pid, est)) = found.best else {
            return;
        };
        if found.valid > 1 && est.is_none() && !fallback {
            self.vms[vid as usize].deferred.push((S::IS_GUEST, id, gen));
            return;
        }
        let (Some(partner), Some(me)) = (self.take::<S::Other>(pid), self.take::<S>(id)) else {
            return;
        };
        let (g, h) = S::refs(&me.rec, &partner.rec);
        let (gt, ht) = S::guest_first(&me.t, &partner.t);
        let cx = JoinCtx {
            vm: &mut self.vms[vid as usize],
            stats: &mut self.stats,
            max_drift_ppm: self.cfg.clock.max_drift_ppm,
        };
        make_joined(cx, (g, gt), (h, ht), est, found.valid == 1, out);
    }
}
