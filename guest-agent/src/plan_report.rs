//! The blind-spot report: what a run cannot see, from the [`Plan`] and what
//! actually loaded and attached.

use std::collections::{BTreeMap, HashSet};

use viotrace_shared::record::Point;

use super::{HookChoice, Plan, EXACT_KICK_TARGET, TYPED_IRQ_PROG, URING_SEES};
use crate::kernel::Facts;

/// Hooks each point depends on: the point is blind unless all of them run.
const POINT_NEEDS: &[(Point, &[&str])] = &[
    (Point::QueueRq, &["virtio_queue_rq", "virtio_queue_rqs"]),
    (Point::VqAdd, &["virtqueue_add_sgs"]),
    (
        Point::Kick,
        &["virtqueue_add_sgs", "virtqueue_kick_prepare"],
    ),
    (
        Point::Irq,
        &[
            "virtqueue_add_sgs",
            "vring_interrupt",
            "blk_mq_complete_request",
        ],
    ),
    (Point::DriverComplete, &["blk_mq_complete_request"]),
    (Point::BioComplete, &["blk_update_request"]),
];

/// What a run cannot see.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Points (stage boundaries) no record of this run will carry.
    pub blind_points: Vec<Point>,
    /// Human lines: what cannot be seen and why.
    pub blind: Vec<String>,
    /// Fallbacks and assumptions.
    pub notes: Vec<String>,
}

/// The report from the plan and what happened: `live` programs loaded and
/// attached; `failed` programs (with the error) did not.
pub fn report(
    plan: &Plan,
    f: &Facts,
    live: &HashSet<String>,
    failed: &BTreeMap<String, String>,
) -> Report {
    let is_live = |c: &HookChoice| {
        let progs = c.programs();
        let own = !progs.is_empty() && progs.iter().all(|p| live.contains(*p));
        // irq_handler_entry stands in for vring_interrupt's kprobe, also when
        // the kernel refused that kprobe (irq_entry is planned only for a
        // kprobe-mode vring_interrupt not left out).
        own || (c.hook.target == "vring_interrupt"
            && (live.contains("irq_entry") || live.contains(TYPED_IRQ_PROG)))
    };
    let satisfied = |target: &str| {
        plan.choice(target)
            .is_some_and(|c| is_live(c) || c.path_absent(f))
    };
    let mut r = Report {
        notes: plan.notes.clone(),
        ..Report::default()
    };
    if !plan.exact_kick && plan.choice("virtqueue_kick_prepare").is_some_and(is_live) {
        r.notes.push(
            "g.kick: when virtqueue_kick_prepare returned (the driver notifies right after; \
             --exact-kick traps virtqueue_notify for its own time)"
                .into(),
        );
    }
    for c in &plan.hooks {
        if is_live(c)
            || c.path_absent(f)
            || (!plan.exact_kick && c.hook.target == EXACT_KICK_TARGET)
        {
            continue;
        }
        // (g.irq's program in fentry mode may be the irq tracepoint's, not the hook's own)
        let typed_irq = plan.typed_irq && c.hook.target == "vring_interrupt";
        let why = c
            .programs()
            .iter()
            .chain(typed_irq.then_some(&TYPED_IRQ_PROG))
            .find_map(|p| failed.get(*p).map(|e| format!("program {p}: {e}")))
            .or_else(|| c.why.clone())
            .unwrap_or_else(|| "not attached".into());
        r.blind.push(format!("{}: {why}", c.hook.sees));
    }
    r.blind.extend(plan.blind.iter().cloned());
    match &plan.uring {
        Ok(p) if !live.contains(*p) => {
            let e = failed.get(*p).map_or("not attached", String::as_str);
            r.blind.push(format!("{URING_SEES}: program {p}: {e}"));
        }
        Ok(_) => {}
        Err(why) => r.blind.push(format!("{URING_SEES}: {why}")),
    }
    for (point, needs) in POINT_NEEDS {
        if !needs.iter().all(|t| satisfied(t)) {
            r.blind_points.push(*point);
        }
    }
    r
}
