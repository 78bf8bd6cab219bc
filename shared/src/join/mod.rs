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
//! submit→complete. A record with several such candidates then stays pending
//! until the VM has a clock sample (arrival order cannot decide: the older
//! candidate may belong to a request whose own record is merely late); if
//! none comes before anything of the VM expires, or at flush, the oldest
//! candidate wins, oldest records first. Every joined
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
//!
//! Layout: `pending` holds each side's pending records (one generic
//! implementation for the guest side and the host side), `matching` finds a
//! record's partner and defers ambiguous choices, `expiry` decides when a
//! record stops waiting, `emit` hands the output records to an [`Output`]
//! as views ([`Emitted`], built into a [`crate::record::JoinedIo`] on request).

mod emit;
mod expiry;
mod host_entry;
mod matching;
mod pending;
#[cfg(any(test, feature = "testing"))]
pub mod synth;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_live;

use std::borrow::Cow;

use crate::clock::{ClockConfig, ClockEstimator};
use crate::record::{GuestRq, HostElem};

use crate::stages;
pub use emit::{Emitted, Output};

use host_entry::HostEntry;
use pending::{Guest, Host, Sides, Times};

/// Join tuning.
#[derive(Clone, Debug)]
pub struct JoinConfig {
    /// How long a record waits for its partner (in its own clock, and in the
    /// other side's progress).
    pub timeout_ns: u64,
    /// Hard cap on pending records per side (all VMs together); when it is
    /// reached the VM with the most pending records loses its oldest.
    pub max_pending: usize,
    /// Cap on pending records per side and VM: a VM over it evicts only its
    /// own records, so a flooding guest cannot push out another VM's.
    pub max_pending_per_vm: usize,
    /// Extra tolerance on every time bound.
    pub slack_ns: u64,
    pub clock: ClockConfig,
}

impl Default for JoinConfig {
    fn default() -> Self {
        JoinConfig {
            timeout_ns: 3_000_000_000,
            max_pending: 1 << 18,
            max_pending_per_vm: 1 << 14,
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
            max_pending_per_vm: 1 << 22,
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

/// Per-VM state shared by both sides.
struct Vm {
    name: String,
    clock: ClockEstimator,
    /// Learned guest disk ↔ host device pairs.
    bindings: Vec<(crate::record::Name, crate::record::Name)>,
    /// Whether headless guest records were seen (then hosts are indexed by sector).
    headless: bool,
    boot_id: Option<String>,
    /// Pending records `(is_guest, id, gen)` with several valid partners while
    /// the clock had no sample (see [`JoinEngine::resolve_deferred`]).
    deferred: Vec<(bool, u32, u32)>,
    /// Whether the guest's record stream is interrupted or catching up.
    stream: GuestStream,
}

/// The state of a VM's guest record stream, for expiry by the host's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GuestStream {
    /// Records arrive as they are made: the guest's progress follows the host's clock.
    Live,
    /// No connection: a reconnection will resend what the host did not
    /// acknowledge, so the guest's progress is not extrapolated.
    Stalled,
    /// Reconnected and resending: live again once its records are recent.
    CatchingUp,
}

/// A catching-up guest stream is live again once its newest record is this
/// close to the host's clock (mapped).
const CAUGHT_UP_NS: u64 = 1_000_000_000;

/// The join engine (single-threaded; one per host agent).
pub struct JoinEngine {
    cfg: JoinConfig,
    vms: Vec<Vm>,
    vm_ids: rustc_hash::FxHashMap<String, u32>,
    /// The VM of the previous record (records come in runs of one VM).
    last_vm: u32,
    sides: Sides,
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
            vm_ids: Default::default(),
            last_vm: 0,
            sides: Sides::new(),
            stats: JoinStats::default(),
        }
    }

    pub fn config(&self) -> &JoinConfig {
        &self.cfg
    }

    pub fn stats(&self) -> JoinStats {
        let mut s = self.stats;
        s.pending_guest = self.sides.guest.len() as u64;
        s.pending_host = self.sides.host.len() as u64;
        s
    }

    fn vm_id(&mut self, vm: &str) -> u32 {
        let last = self.last_vm;
        if self.vms.get(last as usize).is_some_and(|v| v.name == vm) {
            return last;
        }
        if let Some(&id) = self.vm_ids.get(vm) {
            self.last_vm = id;
            return id;
        }
        let id = self.vms.len() as u32;
        self.vms.push(Vm {
            name: vm.to_string(),
            clock: ClockEstimator::new(self.cfg.clock.clone()),
            bindings: Vec::new(),
            headless: false,
            boot_id: None,
            deferred: Vec::new(),
            stream: GuestStream::Live,
        });
        self.sides.guest.add_vm();
        self.sides.host.add_vm();
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

    /// Says whether a VM's guest record stream is interrupted (its connection
    /// is down and a reconnection will resend what was not acknowledged). While
    /// it is, and after it resumes until its records are recent again,
    /// [`JoinEngine::advance`] does not move the guest's progress on by the
    /// host's clock, so host records wait for the resent guest records.
    pub fn set_guest_stalled(&mut self, vm: &str, stalled: bool) {
        let id = self.vm_id(vm);
        let v = &mut self.vms[id as usize];
        v.stream = match (stalled, v.stream) {
            (true, _) => GuestStream::Stalled,
            (false, GuestStream::Live) => GuestStream::Live,
            (false, _) => GuestStream::CatchingUp,
        };
    }

    /// Ends any stall of a VM's guest stream (give up waiting for a resend).
    pub fn set_guest_live(&mut self, vm: &str) {
        let id = self.vm_id(vm);
        self.vms[id as usize].stream = GuestStream::Live;
    }

    /// Forgets a VM's clock (call when its guest rebooted: new boot id).
    pub fn reset_clock(&mut self, vm: &str) {
        let id = self.vm_id(vm);
        self.vms[id as usize].clock = ClockEstimator::new(self.cfg.clock.clone());
        let g = self.sides.guest.vm_mut(id);
        g.now = None;
        g.first = None;
    }

    /// Adds a guest request from VM `vm`; joined or expired records go to `out`.
    pub fn push_guest(&mut self, vm: &str, rq: GuestRq, out: &mut dyn Output) {
        self.stats.guest_records += 1;
        let vid = self.vm_id(vm);
        let t = Times::of::<Guest>(&rq.ts);
        self.push::<Guest>(vid, Cow::Owned(rq), t, out);
    }

    /// [`push_guest`](Self::push_guest) of a record the caller keeps: it is
    /// copied only if it has to wait for its host element.
    pub fn push_guest_ref(&mut self, vm: &str, rq: &GuestRq, out: &mut dyn Output) {
        self.stats.guest_records += 1;
        let vid = self.vm_id(vm);
        let t = Times::of::<Guest>(&rq.ts);
        self.push::<Guest>(vid, Cow::Borrowed(rq), t, out);
    }

    /// Adds a host element (its `vm` field names the VM).
    pub fn push_host(&mut self, el: HostElem, out: &mut dyn Output) {
        self.push_host_ref(&el, out);
    }

    /// [`push_host`](Self::push_host) of an element the caller keeps: what
    /// waits for the guest record is a compact copy of what the join and its
    /// output read (not its VM name, not its wall-clock time).
    pub fn push_host_ref(&mut self, el: &HostElem, out: &mut dyn Output) {
        self.stats.host_records += 1;
        let vid = self.vm_id(&el.vm);
        let t = Times::of::<Host>(&el.ts);
        let e = HostEntry::of(el, (t.first, t.last));
        self.push::<Host>(vid, Cow::Owned(e), t, out);
    }

    /// Tells the engine the host's current time (live mode, when records are
    /// sparse) and emits what timed out.
    pub fn advance(&mut self, host_now: u64, out: &mut dyn Output) {
        for vid in 0..self.vms.len() as u32 {
            self.sides.host.vm_mut(vid).observe(host_now, host_now);
            let v = &mut self.vms[vid as usize];
            let g = self.sides.guest.vm_mut(vid);
            if v.clock.is_synced() && v.stream != GuestStream::Stalled {
                if let Some(e) = v.clock.offset_at(g.now.unwrap_or(0)) {
                    let mapped = host_now.saturating_add_signed(-e.offset_ns);
                    if v.stream == GuestStream::CatchingUp
                        && g.now.unwrap_or(0).saturating_add(CAUGHT_UP_NS) >= mapped
                    {
                        v.stream = GuestStream::Live;
                    }
                    if v.stream == GuestStream::Live {
                        g.now = Some(g.now.map_or(mapped, |n| n.max(mapped)));
                    }
                }
            }
            self.expire_vm(vid, out);
        }
    }

    /// Emits every pending record as unmatched (end of input), oldest first
    /// per side.
    pub fn flush(&mut self, out: &mut dyn Output) {
        for vid in 0..self.vms.len() as u32 {
            self.resolve_deferred(vid, true, out);
        }
        self.drain::<Guest>(out);
        self.drain::<Host>(out);
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
