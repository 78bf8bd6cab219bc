//! Emission: the one place a [`JoinedIo`] is made, for a joined pair and for
//! a record of either side alone; an [`Output`] gets each as an [`Emitted`]
//! view and builds the record only if it needs it.

use crate::clock::{narrow, CausalBounds, OffsetEstimate};
use crate::record::{ClockDomain, GuestRq, JoinedIo, Name, Op, Point, Points, UnmatchedReason};
use crate::stages::{self, Stages};

use super::host_entry::HostEntry;
use super::pending::{Pending, Side, Times};
use super::JoinEngine;

/// The records an output record is made of. They are read in place (a
/// pending record is dropped only once its output is built), not moved.
#[derive(Clone, Copy)]
pub(super) enum Parts<'a> {
    Joined(&'a GuestRq, &'a HostEntry),
    Guest(&'a GuestRq),
    Host(&'a HostEntry),
}

/// The guest→host offset applied to one output record's guest points.
#[derive(Clone, Copy)]
struct Mapping {
    offset_ns: i64,
    /// Unknown when only one causal bound placed the offset.
    uncertainty_ns: Option<u64>,
}

impl From<OffsetEstimate> for Mapping {
    fn from(e: OffsetEstimate) -> Self {
        Mapping {
            offset_ns: e.offset_ns,
            uncertainty_ns: Some(e.uncertainty_ns),
        }
    }
}

/// A record the join emits, borrowed from the join's pending records: what
/// the statistics read without building the output record, which
/// [`Emitted::build_into`] makes only for the records that are written.
pub struct Emitted<'a> {
    /// The VM (a host element's is its VM's name).
    vm: &'a str,
    parts: Parts<'a>,
    /// Its points, in `ts_domain`; the records' own points are not read.
    ts: Points,
    ts_domain: ClockDomain,
    clock_uncertainty_ns: Option<u64>,
    reason: Option<UnmatchedReason>,
}

/// Where the join's records go. A `Vec<JoinedIo>` takes them built.
pub trait Output {
    fn emit(&mut self, r: Emitted<'_>);
}

impl Output for Vec<JoinedIo> {
    fn emit(&mut self, r: Emitted<'_>) {
        r.build_into(self);
    }
}

impl Emitted<'_> {
    fn guest(&self) -> Option<&GuestRq> {
        match self.parts {
            Parts::Joined(g, _) | Parts::Guest(g) => Some(g),
            Parts::Host(_) => None,
        }
    }

    fn host(&self) -> Option<&HostEntry> {
        match self.parts {
            Parts::Joined(_, h) | Parts::Host(h) => Some(h),
            Parts::Guest(_) => None,
        }
    }

    /// [`JoinedIo::vm`].
    pub fn vm(&self) -> &str {
        self.vm
    }

    /// [`JoinedIo::disk`].
    pub fn disk(&self) -> Option<&str> {
        self.guest().map(|g| g.disk.as_str())
    }

    /// [`JoinedIo::device`].
    pub fn device(&self) -> Option<&str> {
        self.host().map(|h| h.device.as_str())
    }

    /// [`JoinedIo::queue`].
    pub fn queue(&self) -> Option<u16> {
        match self.parts {
            Parts::Joined(_, h) | Parts::Host(h) => Some(h.queue),
            Parts::Guest(g) => g.queue,
        }
    }

    /// [`JoinedIo::op`] and [`JoinedIo::bytes`].
    pub fn op_bytes(&self) -> (Op, u32) {
        match self.parts {
            Parts::Joined(g, _) | Parts::Guest(g) => (g.op, g.bytes),
            Parts::Host(h) => (h.op, h.bytes),
        }
    }

    /// [`JoinedIo::ts`]: the stages derive from them.
    pub fn ts(&self) -> &Points {
        &self.ts
    }

    /// [`JoinedIo::clock_uncertainty_ns`].
    pub fn clock_uncertainty_ns(&self) -> Option<u64> {
        self.clock_uncertainty_ns
    }

    /// [`JoinedIo::joined`].
    pub fn joined(&self) -> bool {
        self.reason.is_none()
    }

    /// The output record.
    pub fn build(&self) -> JoinedIo {
        let mut v = Vec::with_capacity(1);
        self.build_into(&mut v);
        v.pop().expect("built above")
    }

    /// Builds the output record at the end of `out` (in place: the 1 KiB
    /// record is not moved after it is made).
    pub fn build_into(&self, out: &mut Vec<JoinedIo>) {
        let (ts, ts_domain) = (self.ts.clone(), self.ts_domain);
        let (op, bytes) = self.op_bytes();
        let sector = match self.parts {
            Parts::Joined(g, _) | Parts::Guest(g) => g.sector,
            Parts::Host(h) => h.sector,
        };
        let (g, h) = (self.guest(), self.host());
        // Left in the guest's clock: the guest's own wall-clock time.
        let time = match ts_domain {
            ClockDomain::Host => crate::walltime::of_points(&ts),
            ClockDomain::Guest => g.and_then(|g| g.time),
        };
        out.push(JoinedIo {
            vm: Name::default(),
            time,
            disk: None,
            device: None,
            queue: None,
            head: None,
            op,
            sector,
            bytes,
            pid: None,
            tid: None,
            comm: None,
            cgroup_id: None,
            inode: None,
            file_offset: None,
            kicked: None,
            error: None,
            qemu_pid: None,
            backend: None,
            merge_id: None,
            status: None,
            ts,
            ts_domain,
            stages: Stages::default(),
            substages: Stages::default(),
            total_ns: None,
            clock_uncertainty_ns: self.clock_uncertainty_ns,
            joined: self.reason.is_none(),
            reason: self.reason,
            cause: None,
            interference: None,
        });
        let io = out.last_mut().expect("pushed above");
        (io.total_ns, _) = stages::derive_into(&io.ts, &mut io.stages, &mut io.substages);
        if let Some(g) = g {
            io.disk = Some(g.disk.clone());
            (io.queue, io.head) = (g.queue, g.head);
            io.pid = Some(g.pid);
            io.tid = Some(g.tid);
            io.comm = Some(g.comm.clone());
            io.cgroup_id = Some(g.cgroup_id);
            io.inode = Some(g.inode);
            io.file_offset = g.file_offset;
            io.kicked = g.kicked;
            io.error = Some(g.error);
        }
        io.vm = self.vm.into();
        if let Some(h) = h {
            io.device = Some(h.device.clone());
            (io.queue, io.head) = (Some(h.queue), Some(h.head));
            io.qemu_pid = Some(h.qemu_pid);
            io.backend = Some(h.backend);
            io.merge_id = Some(h.merge_id);
            io.status = h.status;
            io.interference = h.interference.as_ref().map(|d| {
                Box::new(crate::interference::Interference {
                    device: (**d).clone(),
                    ..Default::default()
                })
            });
        }
    }
}

/// What the emission of a joined pair changes besides its output: the
/// VM's clock and bindings, the join's counters.
pub(super) struct JoinCtx<'a> {
    pub vm: &'a mut super::Vm,
    pub stats: &'a mut super::JoinStats,
    pub max_drift_ppm: f64,
}

/// Emits a joined pair (with each record's causal points, the records read in
/// place), feeds it to the VM's clock when it is a trustworthy sample and
/// learns its disk ↔ device binding.
pub(super) fn make_joined(
    cx: JoinCtx<'_>,
    (rq, g): (&GuestRq, &Times),
    (el, h): (&HostEntry, &Times),
    est: Option<OffsetEstimate>,
    unambiguous: bool,
    out: &mut dyn Output,
) {
    let JoinCtx {
        vm: v,
        stats,
        max_drift_ppm,
    } = cx;
    stats.joined += 1;
    let mut b = CausalBounds::default();
    if let (Some(s), Some(p)) = (g.start, h.start) {
        b = b.before(s, p);
    }
    if let (Some(d), Some(u)) = (g.end, h.end) {
        b = b.after(u, d);
    }
    let max_drift = max_drift_ppm * 1e-6;
    let span = match (g.start, g.end) {
        (Some(s), Some(d)) => d.saturating_sub(s),
        _ => 0,
    };
    let allow = crate::clock::ceil_u64(span as f64 * max_drift).saturating_add(1);
    let (mapping, consistent) = match est {
        Some(e) => match narrow(e, b, allow) {
            Some(n) => (Some(Mapping::from(n)), true),
            None => {
                stats.clock_conflicts += 1;
                (Some(Mapping::from(e)), false)
            }
        },
        // Without a clock the pair's own bounds place it; one-sided or
        // inconsistent bounds place it at the bound, uncertainty unknown.
        None => match b.estimate(allow) {
            Some(n) => (Some(Mapping::from(n)), true),
            None => (
                b.lo.or(b.hi).map(|x| Mapping {
                    offset_ns: x,
                    uncertainty_ns: None,
                }),
                true,
            ),
        },
    };
    // Only an unambiguous pair that agrees with the current estimate
    // becomes a clock sample: a mis-join must not steer the clock.
    if let (Some(s), Some(p), Some(u), Some(d)) = (g.start, h.start, h.end, g.end) {
        if !(unambiguous && consistent) {
            stats.clock_skipped += 1;
        } else if v.clock.add_request(s, p, u, d).is_err() {
            stats.clock_rejected += 1;
        }
    }
    if !v.bindings.iter().any(|(d, _)| *d == rq.disk) {
        v.bindings.push((rq.disk.clone(), el.device.clone()));
    }
    // Without any time relation (no causal points at all) only the host
    // points are kept.
    let ts = match mapping {
        Some(m) => {
            let mut ts = rq.ts.clone();
            ts.shift(m.offset_ns);
            el.overlay_points(&mut ts);
            drop_unrelated_notifications(&mut ts, m.uncertainty_ns.unwrap_or(0));
            ts
        }
        None => el.points(),
    };
    let unc = mapping.and_then(|m| m.uncertainty_ns);
    out.emit(Emitted {
        vm: &v.name,
        parts: Parts::Joined(rq, el),
        ts,
        ts_domain: ClockDomain::Host,
        clock_uncertainty_ns: unc,
        reason: None,
    });
}

impl JoinEngine {
    /// Emits a record of side `S` without a partner (guest points mapped onto
    /// the host clock when the VM has an estimate).
    pub(super) fn unmatched<S: Side>(
        &mut self,
        p: Pending<S::Rec>,
        reason: UnmatchedReason,
        out: &mut dyn Output,
    ) {
        if S::IS_GUEST {
            self.stats.unmatched_guest += 1;
        } else {
            self.stats.unmatched_host += 1;
        }
        if reason == UnmatchedReason::MismatchOpSectorLen {
            self.stats.mismatched += 1;
        }
        let v = &mut self.vms[p.vm as usize];
        let est = if S::IS_GUEST && v.clock.is_synced() {
            v.clock.offset_at(p.t.anchor())
        } else {
            None
        };
        let mut ts = S::points(&p.rec);
        let domain = match est {
            Some(e) => {
                ts.shift(e.offset_ns);
                ClockDomain::Host
            }
            None if S::IS_GUEST => ClockDomain::Guest,
            None => ClockDomain::Host,
        };
        let unc = est.map(|e| e.uncertainty_ns);
        out.emit(Emitted {
            vm: &v.name,
            parts: S::alone(&p.rec),
            ts,
            ts_domain: domain,
            clock_uncertainty_ns: unc,
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
/// * The host's points are the other way round: `h.notify` is the queue's last
///   kick seen by QEMU; when the guest added the element after it (and did not
///   kick: `kicked` false), QEMU found the element while draining the ring for
///   earlier kicks. `h.irq` is the notification after the push; when the guest's
///   handler had completed the request before it, it was for later elements.
///
/// `ts` holds both sides in the host clock; `unc` is the mapping's uncertainty.
/// The stage derivation then uses the next point (`g.vq_add`, `g.driver_complete`),
/// or merges the stages around a host anchor left without a stand-in.
pub(super) fn drop_unrelated_notifications(ts: &mut Points, unc: u64) {
    let added = ts.get(Point::VqAdd).or(ts.get(Point::Kick));
    if let (Some(added), Some(notify)) = (added, ts.get(Point::HostNotify)) {
        if notify.saturating_add(unc) < added {
            ts.remove(Point::HostNotify);
        }
    }
    let handled = ts.get(Point::Irq).or(ts.get(Point::DriverComplete));
    if let (Some(handled), Some(hirq)) = (handled, ts.get(Point::HostIrq)) {
        if handled.saturating_add(unc) < hirq {
            ts.remove(Point::HostIrq);
        }
    }
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
