//! Verdicts on slow syscall-level I/Os in the guest (the guest agent with `-t`):
//! a syscall above the threshold and [`super::SLOW_FACTOR`] × the median of its class
//! (the same command, syscall and size class) is judged by where its excess
//! went, from its off-CPU accounting ([`OffCpu`]): waiting for a CPU while
//! runnable (`guest_preempted`, naming the task that held the CPU), sleeping
//! (`guest_blocked`: its block requests or a lock; their own verdicts are the
//! host's), or neither (`guest_task`: on the CPU in the kernel).

use std::collections::{BTreeMap, HashMap};

use crate::record::{GuestIo, OffCpu, Point};

use super::{fmt_ns, render_causes, size_class, size_class_kib, Cause, CauseKind, Window};

/// Classes (command × syscall × size class) kept; requests of more are counted, not judged.
pub const MAX_SYSCALL_CLASSES: usize = 4096;

#[derive(Default, Debug)]
struct Class {
    total: Window,
    runnable: Window,
    blocked: Window,
}

/// The guest agent's syscall verdicts.
#[derive(Debug)]
pub struct SyscallVerdicts {
    classes: HashMap<(crate::record::Name, crate::record::Name, u8), Class>,
    threshold_ns: i64,
    interval: BTreeMap<(CauseKind, String), u64>,
    /// Syscalls judged slow, in all.
    pub flagged: u64,
    /// Syscalls not judged: their class was beyond [`MAX_SYSCALL_CLASSES`].
    pub classes_refused: u64,
}

impl SyscallVerdicts {
    pub fn new(threshold_ns: u64) -> SyscallVerdicts {
        SyscallVerdicts {
            classes: HashMap::new(),
            threshold_ns: i64::try_from(threshold_ns).unwrap_or(i64::MAX),
            interval: BTreeMap::new(),
            flagged: 0,
            classes_refused: 0,
        }
    }

    /// Judges a syscall record with its off-CPU accounting (others are left
    /// alone) against its class's baseline, then adds it to the baseline.
    pub fn judge(&mut self, io: &mut GuestIo) {
        let (Some(a), Some(b), Some(off)) = (
            io.ts.get(Point::SyscallEnter),
            io.ts.get(Point::SyscallExit),
            io.off_cpu.as_ref(),
        ) else {
            return;
        };
        let (runnable, blocked) = (off.runnable_ns as i64, off.blocked_ns as i64);
        let total = b.saturating_sub(a) as i64;
        let key = (io.comm.clone(), io.syscall.clone(), size_class(io.bytes));
        if !self.classes.contains_key(&key) && self.classes.len() >= MAX_SYSCALL_CLASSES {
            self.classes_refused += 1;
            return;
        }
        let class = self.classes.entry(key).or_default();
        let cause = judge_one(class, io, total, off, self.threshold_ns);
        class.total.push(total);
        class.runnable.push(runnable);
        class.blocked.push(blocked);
        io.cause = cause.map(Box::new);
        if let Some(c) = &io.cause {
            self.flagged += 1;
            *self.interval.entry((c.kind, c.stage.clone())).or_default() += 1;
        }
    }

    /// The interval's causes, most frequent first (`None` when there were none).
    pub fn take_interval(&mut self, title: &str) -> Option<String> {
        render_causes(title, std::mem::take(&mut self.interval))
    }
}

fn judge_one(c: &Class, io: &GuestIo, total: i64, off: &OffCpu, threshold: i64) -> Option<Cause> {
    let base = c.total.slow_baseline(total, threshold)?;
    let excess = total - base;
    let (runnable, blocked) = (off.runnable_ns as i64, off.blocked_ns as i64);
    let explains = |ns: i64| ns.saturating_mul(2) >= excess;
    let (kind, stage, ns, window, why) = if explains(runnable) {
        let holder = off
            .holder
            .as_deref()
            .map_or(String::new(), |h| format!(", the CPU held by {h}"));
        (
            CauseKind::GuestPreempted,
            "guest_runq",
            runnable,
            &c.runnable,
            format!(
                "{} was runnable but not running for {} inside {}{holder}",
                io.comm,
                fmt_ns(runnable),
                io.syscall
            ),
        )
    } else if explains(blocked) {
        (
            CauseKind::GuestBlocked,
            "guest_blocked",
            blocked,
            &c.blocked,
            format!(
                "{} slept {} inside {} (its block requests or a lock)",
                io.comm,
                fmt_ns(blocked),
                io.syscall
            ),
        )
    } else {
        let on_cpu = total - runnable - blocked;
        (
            CauseKind::GuestTask,
            "guest_on_cpu",
            on_cpu,
            &c.total,
            format!(
                "{} ran {} on the CPU inside {}",
                io.comm,
                fmt_ns(on_cpu),
                io.syscall
            ),
        )
    };
    let baseline_ns = if stage == "guest_on_cpu" {
        0
    } else {
        window.median().unwrap_or(0)
    };
    Some(Cause {
        kind,
        stage: stage.to_string(),
        stage_ns: ns,
        baseline_ns,
        total_ns: total,
        baseline_total_ns: base,
        evidence: format!(
            "{why}; {} +{} over its baseline {} (median of the last {} {} calls of {} ≤{} KiB)",
            io.syscall,
            fmt_ns(excess),
            fmt_ns(base),
            c.total.len(),
            io.syscall,
            io.comm,
            size_class_kib(size_class(io.bytes))
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Points;

    fn io(total: u64, runnable: u64, blocked: u64) -> GuestIo {
        let mut ts = Points::new();
        ts.set(Point::SyscallEnter, 1_000);
        ts.set(Point::SyscallExit, 1_000 + total);
        GuestIo {
            syscall: "pread64".into(),
            time: None,
            pid: 7,
            tid: 7,
            comm: "fio".into(),
            cgroup_id: 1,
            inode: 2,
            file_offset: None,
            bytes: 4096,
            ret: 4096,
            requests: Default::default(),
            requests_unlisted: 0,
            ts,
            off_cpu: Some(OffCpu {
                runnable_ns: runnable,
                blocked_ns: blocked,
                holder: Some("pid 99 sh".into()),
            }),
            cause: None,
        }
    }

    #[test]
    fn a_preempted_syscall_is_named_with_the_holder_and_a_steady_one_is_not() {
        let mut v = SyscallVerdicts::new(1_000_000);
        for _ in 0..32 {
            let mut i = io(500_000, 10_000, 400_000);
            v.judge(&mut i);
            assert!(i.cause.is_none());
        }
        let mut slow = io(8_000_000, 7_000_000, 500_000);
        v.judge(&mut slow);
        let c = slow.cause.as_ref().expect("judged");
        assert_eq!(
            (c.kind, c.stage.as_str()),
            (CauseKind::GuestPreempted, "guest_runq")
        );
        assert!(
            c.evidence.starts_with(
                "fio was runnable but not running for 7.0 ms inside pread64, the CPU held by pid 99 sh; pread64 +7.5 ms over its baseline 500 µs"
            ),
            "{}",
            c.evidence
        );
        let mut blocked = io(8_000_000, 100_000, 7_500_000);
        v.judge(&mut blocked);
        assert_eq!(blocked.cause.unwrap().kind, CauseKind::GuestBlocked);
        let mut on_cpu = io(8_000_000, 100_000, 400_000);
        v.judge(&mut on_cpu);
        assert_eq!(on_cpu.cause.unwrap().kind, CauseKind::GuestTask);
        // under the threshold, or without off-CPU accounting: not judged
        let mut fast = io(900_000, 800_000, 0);
        v.judge(&mut fast);
        assert!(fast.cause.is_none());
        let mut none = io(8_000_000, 7_000_000, 0);
        none.off_cpu = None;
        v.judge(&mut none);
        assert!(none.cause.is_none());
        assert_eq!(v.flagged, 3);
        let t = v.take_interval("== causes").unwrap();
        assert!(
            t.contains("guest_preempted") && t.contains("guest_runq"),
            "{t}"
        );
    }

    #[test]
    fn classes_are_bounded_and_refusals_counted() {
        let mut v = SyscallVerdicts::new(1);
        for k in 0..(MAX_SYSCALL_CLASSES + 3) {
            let mut i = io(10, 0, 0);
            i.comm = compact_str::format_compact!("c{k}");
            v.judge(&mut i);
        }
        assert_eq!(v.classes_refused, 3);
    }
}
