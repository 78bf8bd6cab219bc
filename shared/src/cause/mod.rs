//! "Why was this I/O slow": a verdict per slow request.
//!
//! For each request the engine compares every stage with that stage's recent
//! baseline (the median of the last [`WINDOW`] requests of the same *class*: VM,
//! disk, op and size class) and names the stage with the largest excess over its
//! baseline. A request is judged slow only when its total exceeds both the
//! absolute threshold and [`SLOW_FACTOR`] × its class's baseline total, so a
//! steady workload is not flagged at all. The stage (refined by its sub-stages
//! where they exist) gives the most likely cause class; the evidence text says by
//! how much the stage exceeded its baseline.
//!
//! The engine only knows what the record carries (stages and sub-stages): it does
//! not yet see scheduling or other processes' I/O, so its causes name *where* the
//! time went (e.g. `qemu_queue`: inside QEMU before the host system call — its I/O
//! throttling or a busy thread pool), not *who* caused it.

mod baseline;
pub mod syscall;

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::interference::Interference;
use crate::record::{JoinedIo, Op};
use crate::stages::Stages;

pub use baseline::{Window, WINDOW};

/// A request is slow when its total exceeds this factor times its class's baseline total.
pub const SLOW_FACTOR: f64 = 3.0;

/// Requests a class must have seen before its requests are judged.
pub const MIN_SAMPLES: usize = 16;

/// The most likely cause class of a slow request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum CauseKind {
    /// In the guest before the block layer or after completion (file system, the
    /// submitting task off-CPU).
    GuestTask,
    /// The guest's block layer and driver queues.
    GuestQueue,
    /// Between the guest's kick and QEMU popping the request (vCPU exit, QEMU's
    /// event loop not running).
    HostNotify,
    /// Inside QEMU before the host system call: I/O throttling, a busy thread pool,
    /// QEMU's threads not running.
    QemuQueue,
    /// The host kernel and device (the backing disk busy, e.g. other I/O on it).
    HostDevice,
    /// QEMU's completion path up to the interrupt (reaping, pushing, notifying).
    QemuCompletion,
    /// From QEMU's notification to the guest's interrupt handler.
    IrqDelivery,
    /// The guest's completion path (interrupt to request completion, softirq).
    GuestCompletion,
    /// A host-side stage grew while QEMU's own threads (main loop, I/O threads,
    /// workers) were runnable but not running: QEMU starved of CPU.
    QemuStarved,
    /// The kick or the interrupt was late while this VM's vCPU threads waited for
    /// a host CPU.
    VcpuPreempted,
    /// The host I/O grew while other processes or VMs issued requests to the same
    /// host device.
    NoisyNeighbour,
    /// A guest syscall waited for a guest CPU while runnable (a CPU hog in the guest).
    GuestPreempted,
    /// A guest syscall slept (its block requests, a lock).
    GuestBlocked,
}

impl CauseKind {
    pub const fn name(self) -> &'static str {
        match self {
            CauseKind::GuestTask => "guest_task",
            CauseKind::GuestQueue => "guest_queue",
            CauseKind::HostNotify => "host_notify",
            CauseKind::QemuQueue => "qemu_queue",
            CauseKind::HostDevice => "host_device",
            CauseKind::QemuCompletion => "qemu_completion",
            CauseKind::IrqDelivery => "irq_delivery",
            CauseKind::GuestCompletion => "guest_completion",
            CauseKind::QemuStarved => "qemu_starved",
            CauseKind::VcpuPreempted => "vcpu_preempted",
            CauseKind::NoisyNeighbour => "noisy_neighbour",
            CauseKind::GuestPreempted => "guest_preempted",
            CauseKind::GuestBlocked => "guest_blocked",
        }
    }
}

/// The verdict on one slow request (JSON: the record's `cause` object).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cause {
    pub kind: CauseKind,
    /// The stage (or sub-stage) that dominated.
    pub stage: String,
    /// Its duration in this request and its class baseline (median), ns.
    pub stage_ns: i64,
    pub baseline_ns: i64,
    /// The request's total and its class's baseline total, ns.
    pub total_ns: i64,
    pub baseline_total_ns: i64,
    /// Human-readable evidence.
    pub evidence: String,
}

/// The class a request is compared within.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClassKey {
    pub vm: String,
    pub disk: String,
    pub op: Op,
    /// log2 of the size rounded up to 4 KiB units (0: ≤ 4 KiB, 1: ≤ 8 KiB, …).
    pub size_class: u8,
}

/// The size class of a request of `bytes`: log2 of its size rounded up to 4 KiB
/// units (0: ≤ 4 KiB, 1: ≤ 8 KiB, …).
pub fn size_class(bytes: u64) -> u8 {
    let units = bytes.div_ceil(4096).max(1);
    (64 - (units - 1).leading_zeros()) as u8
}

/// The largest size of a size class, KiB.
pub fn size_class_kib(class: u8) -> u64 {
    4u64 << class
}

impl ClassKey {
    pub fn new(vm: &str, disk: &str, op: Op, bytes: u32) -> ClassKey {
        ClassKey {
            vm: vm.to_string(),
            disk: disk.to_string(),
            op,
            size_class: size_class(u64::from(bytes)),
        }
    }

    fn label(&self) -> String {
        let kib = size_class_kib(self.size_class);
        format!("{} ≤{kib} KiB on {}/{}", self.op, self.vm, self.disk)
    }
}

/// Which cause a stage (or sub-stage) points to.
pub fn kind_of_stage(stage: &str) -> Option<CauseKind> {
    Some(match stage {
        "guest_fs" | "guest_return" => CauseKind::GuestTask,
        "guest_queue" | "guest_driver" | "guest_queue+guest_driver" => CauseKind::GuestQueue,
        "kick_to_pop" => CauseKind::HostNotify,
        "qemu_submit" | "host_io.queue" => CauseKind::QemuQueue,
        "host_io" | "host_io.kernel" | "host_io.disk" => CauseKind::HostDevice,
        "qemu_complete" | "host_io.reap" | "push_to_irq.notify" => CauseKind::QemuCompletion,
        "push_to_irq" | "push_to_irq.delivery" => CauseKind::IrqDelivery,
        "guest_complete" => CauseKind::GuestCompletion,
        "device" => CauseKind::HostDevice,
        _ => return None,
    })
}

/// Per-class baselines and the verdicts.
#[derive(Debug, Default)]
pub struct Engine {
    classes: HashMap<ClassKey, ClassBaseline>,
    /// Limit on the number of classes kept (oldest-seen classes are not evicted:
    /// new ones beyond the limit are counted and not judged).
    max_classes: usize,
    /// Requests of classes refused because of `max_classes`.
    pub classes_refused: u64,
}

#[derive(Debug, Default)]
struct ClassBaseline {
    total: Window,
    stages: HashMap<String, Window>,
}

impl Engine {
    pub fn new(max_classes: usize) -> Engine {
        Engine {
            max_classes,
            ..Default::default()
        }
    }

    /// Judges one request against its class's baseline (before it joins the
    /// baseline), then adds it. `threshold_ns`: the absolute slowness threshold.
    pub fn observe(
        &mut self,
        key: &ClassKey,
        stages: &Stages,
        substages: &Stages,
        total_ns: i64,
        threshold_ns: i64,
        ev: Option<&Interference>,
    ) -> Option<Cause> {
        if !self.classes.contains_key(key) && self.classes.len() >= self.max_classes {
            self.classes_refused += 1;
            return None;
        }
        let class = match self.classes.get_mut(key) {
            Some(c) => c,
            None => self.classes.entry(key.clone()).or_default(),
        };
        let verdict = class
            .judge(key, stages, substages, total_ns, threshold_ns)
            .map(|c| refine(c, ev));
        class.total.push(total_ns);
        for (name, v) in stages.iter().chain(substages.iter()) {
            match class.stages.get_mut(name) {
                Some(w) => w.push(v),
                None => class.stages.entry(name.to_string()).or_default().push(v),
            }
        }
        verdict
    }
}

/// Classes one host agent keeps baselines for (VMs × disks × ops × size classes).
pub const MAX_CLASSES: usize = 4096;

/// The host agent's verdicts: judges each joined request above the threshold
/// against its class's baseline, puts the [`Cause`] on the record and counts the
/// causes of the current interval for the periodic table.
#[derive(Debug)]
pub struct Verdicts {
    engine: Engine,
    threshold_ns: i64,
    interval: BTreeMap<(CauseKind, String), u64>,
    /// Records judged slow, in all.
    pub flagged: u64,
}

impl Verdicts {
    pub fn new(threshold_ns: u64) -> Verdicts {
        Verdicts {
            engine: Engine::new(MAX_CLASSES),
            threshold_ns: i64::try_from(threshold_ns).unwrap_or(i64::MAX),
            interval: BTreeMap::new(),
            flagged: 0,
        }
    }

    /// Requests not judged because [`MAX_CLASSES`] classes were taken.
    pub fn classes_refused(&self) -> u64 {
        self.engine.classes_refused
    }

    /// Whether [`Verdicts::judge`] may flag this record (joined, above the
    /// threshold): only those need their interference evidence.
    pub fn may_judge(&self, io: &JoinedIo) -> bool {
        io.joined && io.total_ns.is_some_and(|t| t >= self.threshold_ns)
    }

    /// Judges a joined record (others are left alone) and sets its `cause`.
    pub fn judge(&mut self, io: &mut JoinedIo) {
        let (true, Some(total)) = (io.joined, io.total_ns) else {
            return;
        };
        let disk = io.disk.as_deref().or(io.device.as_deref()).unwrap_or("?");
        let key = ClassKey::new(&io.vm, disk, io.op, io.bytes);
        io.cause = self
            .engine
            .observe(
                &key,
                &io.stages,
                &io.substages,
                total,
                self.threshold_ns,
                io.interference.as_deref(),
            )
            .map(Box::new);
        if let Some(c) = &io.cause {
            self.flagged += 1;
            *self.interval.entry((c.kind, c.stage.clone())).or_default() += 1;
        }
    }

    /// The interval's causes, most frequent first (`None` when there were none),
    /// and a fresh interval.
    pub fn take_interval(&mut self, title: &str) -> Option<String> {
        render_causes(title, std::mem::take(&mut self.interval))
    }
}

impl ClassBaseline {
    fn judge(
        &self,
        key: &ClassKey,
        stages: &Stages,
        substages: &Stages,
        total_ns: i64,
        threshold_ns: i64,
    ) -> Option<Cause> {
        let base_total = self.total.slow_baseline(total_ns, threshold_ns)?;
        // The partition stage with the largest excess over its own baseline.
        let excess = |name: &str, v: i64| {
            let base = self.stages.get(name).and_then(|w| w.median()).unwrap_or(0);
            (v - base, base)
        };
        let (stage, v) = stages
            .iter()
            .filter(|(n, _)| kind_of_stage(n).is_some())
            .max_by_key(|(n, v)| excess(n, *v).0)?;
        let (ex, base) = excess(stage, v);
        if ex <= 0 {
            return None;
        }
        // Refine by the sub-stage of that stage with the largest excess, when it
        // explains most of the stage's excess.
        let prefix = format!("{stage}.");
        let refined = substages
            .iter()
            .filter(|(n, _)| n.starts_with(&prefix) && kind_of_stage(n).is_some())
            .map(|(n, sv)| (n, sv, excess(n, sv)))
            .max_by_key(|e| e.2 .0)
            .filter(|e| e.2 .0 * 2 > ex);
        let (name, sv, (sex, sbase)) = refined.unwrap_or((stage, v, (ex, base)));
        let kind = kind_of_stage(name)?;
        Some(Cause {
            kind,
            stage: name.to_string(),
            stage_ns: sv,
            baseline_ns: sbase,
            total_ns,
            baseline_total_ns: base_total,
            evidence: format!(
                "{name} +{} over its baseline {} (total {} vs {}; median of the last {} {} requests)",
                fmt_ns(sex),
                fmt_ns(sbase),
                fmt_ns(total_ns),
                fmt_ns(base_total),
                self.total.len(),
                key.label()
            ),
        })
    }
}

/// Other issuers' requests around a host I/O (in flight at its issue and issued
/// meanwhile), or their bytes issued meanwhile, that make it a neighbour's doing.
pub const MIN_NEIGHBOUR_LOAD: u32 = 2;
pub const MIN_NEIGHBOUR_BYTES: u64 = 256 << 10;

/// Names who caused a verdict's stage to grow, when the interference evidence
/// explains it: the vCPUs (for the kick and the interrupt) waiting for a CPU
/// for at least half the stage's excess; for a host device stage, other
/// issuers' requests on the device; else QEMU's own threads (for any stage)
/// waiting for a CPU for at least half the excess (measured over the whole
/// request, so a device stage prefers the neighbours, which are its own).
pub fn refine(mut c: Cause, ev: Option<&Interference>) -> Cause {
    let Some(ev) = ev else { return c };
    let excess = (c.stage_ns - c.baseline_ns).max(1) as u64;
    let holder = ev
        .cpu_holder
        .as_deref()
        .map_or(String::new(), |h| format!(", the CPU held by {h}"));
    let qemu = ev.qemu_wait_ns.unwrap_or(0);
    let vcpu = ev.vcpu_wait_ns.unwrap_or(0);
    let explains = |ns: u64| ns.saturating_mul(2) >= excess;
    use CauseKind::*;
    let (kind, why) = match c.kind {
        HostNotify | IrqDelivery if explains(vcpu) && vcpu >= qemu => (
            VcpuPreempted,
            format!(
                "the VM's vCPU threads waited {} for a host CPU{holder}",
                fmt_ns(vcpu as i64)
            ),
        ),
        HostDevice
            if ev.neighbour_load() >= MIN_NEIGHBOUR_LOAD
                || ev.device.neighbour_bytes.unwrap_or(0) >= MIN_NEIGHBOUR_BYTES =>
        {
            (
                NoisyNeighbour,
                format!(
                    "{} other requests ({}) on {} during it ({} in flight at its issue){}",
                    ev.device.neighbour_issued.unwrap_or(0),
                    fmt_bytes(ev.device.neighbour_bytes.unwrap_or(0)),
                    ev.device.host_disk.as_deref().unwrap_or("its host device"),
                    ev.device.neighbour_inflight.unwrap_or(0),
                    if ev.neighbours.is_empty() {
                        String::new()
                    } else {
                        format!("; top issuers: {}", ev.neighbours.join(", "))
                    }
                ),
            )
        }
        // Any stage: a preempted QEMU thread holding QEMU's big lock stalls the
        // vCPUs too (vCPU exits, and all of TCG, need it).
        _ if explains(qemu) => (
            QemuStarved,
            format!(
                "QEMU's threads were runnable but not running for {}{holder}",
                fmt_ns(qemu as i64)
            ),
        ),
        GuestQueue if ev.queue_overlap.unwrap_or(0) > 0 => (
            GuestQueue,
            format!(
                "{} other requests of the VM on its queue overlapped it",
                ev.queue_overlap.unwrap_or(0)
            ),
        ),
        _ => return c,
    };
    c.kind = kind;
    c.evidence = format!("{why}; {}", c.evidence);
    c
}

/// The table of an interval's causes, most frequent first (`None` when empty).
pub fn render_causes(title: &str, interval: BTreeMap<(CauseKind, String), u64>) -> Option<String> {
    if interval.is_empty() {
        return None;
    }
    let mut v: Vec<((CauseKind, String), u64)> = interval.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut out = format!(
        "{title}\n    {:<18} {:<24} {:>8}\n",
        "cause", "stage", "slow I/Os"
    );
    for ((kind, stage), n) in v.iter().take(8) {
        out += &format!("    {:<18} {:<24} {:>8}\n", kind.name(), stage, n);
    }
    Some(out)
}

/// `3.5 MiB`, `12 KiB`, `512 B`.
pub fn fmt_bytes(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else if b >= 1 << 10 {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// `38.0 ms`, `412 µs`, `900 ns`.
pub fn fmt_ns(ns: i64) -> String {
    let a = ns.unsigned_abs();
    let sign = if ns < 0 { "-" } else { "" };
    if a >= 1_000_000 {
        format!("{sign}{:.1} ms", a as f64 / 1e6)
    } else if a >= 1_000 {
        format!("{sign}{} µs", a / 1_000)
    } else {
        format!("{sign}{a} ns")
    }
}

#[cfg(test)]
mod tests;
