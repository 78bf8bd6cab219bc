//! Always-on's requests counted by stage in the guest kernel
//! (bpf/guest/guest_rq_summary.h), when nothing but the tables reads their
//! records: the plans the BPF side follows, and what its rows gained.
//!
//! A plan is written for a (disk, points seen) set from the first record of
//! that set: [`stage_ends`], the very partition the tables apply to a record,
//! as (from, to, row) steps over the BPF side's `ts[]`. From then on such a
//! request is counted in its rows and sends no record; what no plan covers
//! (a set of points not seen yet, a plan slot taken, the rows full, a stage of
//! 2^31 ns or more) sends its record, which the tables record as before; the
//! record of a set whose plan slot is empty wakes the agent at once. The
//! tables are the same either way (`counting_by_stage_ends_equals_recording_the_points`
//! in viotrace-shared).

use std::collections::HashSet;
use std::sync::atomic::{compiler_fence, Ordering};

use viotrace_shared::proto::rq_bpf::{off, TS_LEN};
use viotrace_shared::record::{Name, Point, Points};
use viotrace_shared::stages::{stage_ends, StageId};

use crate::bpf::types::rq_plan;
use crate::io_hist::{RowDiff, ROW_SLOTS};

/// `RQ_ROWS`, `RQ_PLANS`, `RQ_PLAN_STEPS` of the BPF side.
pub const RQ_ROWS: usize = 32;
pub const RQ_PLANS: usize = 16;
const RQ_PLAN_STEPS: usize = 8;

/// The plan slot of (dev, mask): `rq_plan_index` of the BPF side.
pub fn plan_index(dev: u32, mask: u32) -> usize {
    ((dev ^ mask.wrapping_mul(0x9E37_79B1)).wrapping_mul(0x85EB_CA77) >> 28) as usize % RQ_PLANS
}

/// (dev, bit i: `ts[i]` seen) of a request record as the ring buffer holds it.
pub fn key_of(raw: &[u8]) -> Option<(u32, u32)> {
    let dev = u32::from_ne_bytes(raw.get(off::DEV..off::DEV + 4)?.try_into().ok()?);
    let ts = raw.get(off::TS..off::TS + 8 * TS_LEN)?;
    let mask = ts
        .chunks_exact(8)
        .enumerate()
        .filter(|(_, t)| t.iter().any(|&b| b != 0))
        .fold(0u32, |m, (i, _)| m | 1 << i);
    Some((dev, mask))
}

/// A set's plan to write: its label and its steps as (stage, from, to) slots.
struct Wanted {
    dev: u32,
    mask: u32,
    disk: Name,
    steps: Vec<(StageId, u8, u8)>,
}

/// What a row gained since the last read.
pub struct RowGain {
    pub disk: Name,
    pub stage: StageId,
    pub slots: Vec<(usize, u64)>,
    pub sum_ns: u128,
}

pub struct RqSummary {
    /// The BPF `ts[]` slot of each point, by point id.
    slot_of: Vec<Option<u8>>,
    /// Each row's (dev, stage), and its disk's name.
    rows: Vec<(u32, StageId, Name)>,
    /// The (dev, mask) of each plan slot written.
    planned: [Option<(u32, u32)>; RQ_PLANS],
    /// Sets that will have no plan (their slot taken by another's).
    refused: HashSet<(u32, u32)>,
    wanted: Vec<Wanted>,
    diff: RowDiff,
    /// Each row's sum as last read.
    sums: Vec<u64>,
    /// Sets not counted for want of a slot or rows (their records still
    /// come, and are tabled).
    pub unplanned: u64,
}

impl RqSummary {
    /// `points[i]`: the point of the BPF side's `ts[i]` (`raw::point_slots`).
    pub fn new(points: &[Option<Point>]) -> Self {
        let mut slot_of = vec![None; 64];
        for (i, p) in points.iter().enumerate() {
            if let Some(p) = p {
                slot_of[*p as usize] = u8::try_from(i).ok();
            }
        }
        RqSummary {
            slot_of,
            rows: Vec::new(),
            planned: [None; RQ_PLANS],
            refused: HashSet::new(),
            wanted: Vec::new(),
            diff: RowDiff::default(),
            sums: vec![0; RQ_ROWS],
            unplanned: 0,
        }
    }

    /// A request that sent its record (`raw`, decoded as `disk`, `ts`): its
    /// set is planned at the next [`RqSummary::install`], if it has no plan.
    pub fn note(&mut self, raw: &[u8], disk: &Name, ts: &Points) {
        let Some(key) = key_of(raw) else { return };
        if self.planned[plan_index(key.0, key.1)] == Some(key)
            || self.refused.contains(&key)
            || self.wanted.iter().any(|w| (w.dev, w.mask) == key)
        {
            return;
        }
        let steps: Option<Vec<_>> = stage_ends(ts)
            .into_iter()
            .map(|(id, a, b)| Some((id, self.slot_of[a as usize]?, self.slot_of[b as usize]?)))
            .collect();
        // (fewer than two anchors: nothing to count but the record; such a
        // set gets a plan of no steps, which stops its records waking the agent)
        let steps = steps
            .filter(|s| s.len() <= RQ_PLAN_STEPS)
            .unwrap_or_default();
        self.wanted.push(Wanted {
            dev: key.0,
            mask: key.1,
            disk: disk.clone(),
            steps,
        });
    }

    /// Writes the plans noted since the last call into the kernel's table.
    /// A set whose slot is taken gets none (its records come, without
    /// waking the agent); one that cannot be counted (no stage, the rows
    /// full) a plan of no steps.
    pub fn install(&mut self, plans: &mut [rq_plan; RQ_PLANS]) {
        for w in std::mem::take(&mut self.wanted) {
            let key = (w.dev, w.mask);
            let i = plan_index(w.dev, w.mask);
            if self.planned[i].is_some() {
                self.refused.insert(key);
                self.unplanned += 1;
                continue;
            }
            let rows = match w.steps.is_empty() {
                true => Some(Vec::new()),
                false => self.rows_for(&w),
            };
            let rows = rows.unwrap_or_else(|| {
                self.unplanned += 1;
                Vec::new()
            });
            let p = &mut plans[i];
            p.dev = w.dev;
            p.mask = w.mask;
            p.n = rows.len() as u32;
            for ((s, &(_, from, to)), row) in p.steps.iter_mut().zip(&w.steps).zip(rows) {
                s.from = from;
                s.to = to;
                s.row = row;
            }
            // (the BPF side reads `ready` first: the rest must be there)
            compiler_fence(Ordering::SeqCst);
            p.ready = 1;
            self.planned[i] = Some(key);
        }
    }

    /// The row of each of `w`'s steps, new ones taken; `None` (and none
    /// taken) if they do not all fit.
    fn rows_for(&mut self, w: &Wanted) -> Option<Vec<u16>> {
        let find = |rows: &[(u32, StageId, Name)], id: StageId| {
            rows.iter().position(|r| r.0 == w.dev && r.1 == id)
        };
        let new = w
            .steps
            .iter()
            .filter(|s| find(&self.rows, s.0).is_none())
            .count();
        if self.rows.len() + new > RQ_ROWS {
            return None;
        }
        let mut out = Vec::with_capacity(w.steps.len());
        for &(id, _, _) in &w.steps {
            let r = find(&self.rows, id).unwrap_or_else(|| {
                self.rows.push((w.dev, id, w.disk.clone()));
                self.rows.len() - 1
            });
            out.push(r as u16);
        }
        Some(out)
    }

    /// What the rows in use gained since the last call; `sums`: the rows'
    /// sums, read after `rows` and `counts`.
    pub fn take(
        &mut self,
        rows: &[[u32; ROW_SLOTS]],
        counts: &[u64],
        sums: impl Fn(usize) -> u64,
    ) -> Vec<RowGain> {
        let n = self.rows.len().min(rows.len()).min(counts.len());
        let moved = self.diff.moved(&rows[..n], &counts[..n]);
        compiler_fence(Ordering::SeqCst);
        moved
            .into_iter()
            .map(|(i, slots)| {
                let s = sums(i);
                let gained = s.wrapping_sub(std::mem::replace(&mut self.sums[i], s));
                RowGain {
                    disk: self.rows[i].2.clone(),
                    stage: self.rows[i].1,
                    slots,
                    sum_ns: u128::from(gained),
                }
            })
            .collect()
    }
}

#[cfg(test)]
#[path = "rq_summary_tests.rs"]
mod tests;
