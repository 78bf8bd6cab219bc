//! Always-on requests without records: the kernel counts their stages
//! (bpf/guest/guest_rq_stats.h) and this side hands it the stage plan of
//! every set of points a request can have, gives disks their rows, and reads
//! the rows that moved once an interval into the sink's tables.
//!
//! The plans come from [`point_plan`], the very resolution the tables use
//! for a record's points, so a summarized request lands in the same stages,
//! slots and sums as its record would have.

use std::collections::BTreeSet;
use std::mem::size_of;
use std::path::Path;

use anyhow::{bail, Context, Result};
use libbpf_rs::{MapCore, MapFlags};
use viotrace_shared::record::Point;
use viotrace_shared::stages::{point_plan, StageId};

use crate::bpf::types::{rq_hist_row, rq_plan};
use crate::bpf::ViotraceGuestSkel;
use crate::io_hist::RowDiff;
use crate::sink::Sink;

/// Steps of one plan (`RQ_STEPS`): `rq_plan` is `n` and three arrays of them.
const STEPS: usize = (size_of::<rq_plan>() - 1) / 3;
const _: () = assert!(size_of::<rq_plan>() == 1 + 3 * STEPS);

/// One step of a plan: (from slot, to slot, local stage).
pub type Step = (u8, u8, u8);

/// Every presence mask's plan as (from slot, to slot, local stage) steps, and
/// the stage of each local index: what `rq_plans` holds.
#[derive(Debug, Default, PartialEq)]
pub struct Plans {
    pub masks: Vec<(u32, Vec<Step>)>,
    pub stages: Vec<StageId>,
}

/// The plans of the requests' `ts[]` slots (`slots[i]`: the point of slot
/// `i`), at most `max_steps` steps each, with at most `max_stages` distinct
/// stages. A mask left out sends its records. Requests never carry
/// `g.syscall_exit` (their syscall has not returned when they finish): masks
/// with it are left out, which leaves every span of the other anchors room.
pub fn plans(slots: &[Option<Point>], max_steps: usize, max_stages: usize) -> Plans {
    let mut out = Plans::default();
    let slot_of = |p: Point| slots.iter().position(|s| *s == Some(p));
    for mask in 0u32..1 << slots.len() {
        let present: Vec<Point> = (0..slots.len())
            .filter(|i| mask & 1 << i != 0)
            .filter_map(|i| slots[i])
            .collect();
        if present.contains(&Point::SyscallExit) {
            continue;
        }
        let steps = point_plan(&present);
        let n = steps.len();
        if n == 0 || n > max_steps {
            continue;
        }
        let mut plan = Vec::with_capacity(n);
        for (id, a, b) in steps {
            let local = match out.stages.iter().position(|s| *s == id) {
                Some(k) => k,
                None if out.stages.len() < max_stages => {
                    out.stages.push(id);
                    out.stages.len() - 1
                }
                None => break,
            };
            let (Some(a), Some(b)) = (slot_of(a), slot_of(b)) else {
                break;
            };
            plan.push((a as u8, b as u8, local as u8));
        }
        if plan.len() == n {
            out.masks.push((mask, plan));
        }
    }
    out
}

/// The BPF plan struct of some steps (at most [`STEPS`]).
fn bpf_plan(steps: &[Step]) -> rq_plan {
    let mut p = rq_plan {
        n: steps.len() as u8,
        ..Default::default()
    };
    for (k, &(a, b, s)) in steps.iter().enumerate().take(STEPS) {
        (p.from[k], p.to[k], p.stage[k]) = (a, b, s);
    }
    p
}

fn plan_bytes(p: &rq_plan) -> Vec<u8> {
    [&[p.n][..], &p.from, &p.to, &p.stage].concat()
}

/// The disks to give rows: `only` (the `--disk` filter), else the block
/// devices of `/sys/block`, virtio disks first, loop and RAM disks left out;
/// as (dev as the BPF side writes it, name).
pub fn pick_disks(sys_block: &Path, only: Option<(i32, i32)>, max: usize) -> Vec<(u32, String)> {
    let dev = |maj: i32, min: i32| (maj as u32) << 20 | (min as u32 & 0xf_ffff);
    let mut found: BTreeSet<(bool, String, u32)> = BTreeSet::new();
    for e in std::fs::read_dir(sys_block).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if ["loop", "ram", "zram"].iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let Ok(s) = std::fs::read_to_string(e.path().join("dev")) else {
            continue;
        };
        let Some((a, b)) = s.trim().split_once(':') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (a.parse(), b.parse()) else {
            continue;
        };
        if only.is_some_and(|o| o != (a, b)) {
            continue;
        }
        found.insert((!name.starts_with("vd"), name, dev(a, b)));
    }
    found
        .into_iter()
        .take(max)
        .map(|(_, n, d)| (d, n))
        .collect()
}

/// The running summaries: what was handed down, and the rows as last read.
pub struct RqHist {
    stages: Vec<StageId>,
    /// (dev, name) of each disk's rows, by disk index.
    disks: Vec<(u32, String)>,
    rows: RowDiff,
    sums: Vec<u64>,
    summarized: u64,
}

impl RqHist {
    /// Hands the plans and the disks to the loaded object. Until this returns
    /// every request sends its record, as after a failure here.
    pub fn start(skel: &mut ViotraceGuestSkel<'_>, disks: Vec<(u32, String)>) -> Result<RqHist> {
        let slots = crate::raw::point_slots();
        let bss = skel.maps.bss_data.as_deref_mut().context("no .bss")?;
        let (max_disks, rows) = (bss.rq_disk_devs.len(), bss.rq_row_counts.len());
        let plans = plans(&slots, STEPS, rows / max_disks);
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for (mask, steps) in &plans.masks {
            keys.extend_from_slice(&mask.to_ne_bytes());
            values.extend(plan_bytes(&bpf_plan(steps)));
        }
        let n = plans.masks.len() as u32;
        let map = &skel.maps.rq_plans;
        if map.value_size() as usize != size_of::<rq_plan>() {
            bail!("rq_plans holds {} bytes, not a plan's", map.value_size());
        }
        if map
            .update_batch(&keys, &values, n, MapFlags::ANY, MapFlags::ANY)
            .is_err()
        {
            // (kernels without batch updates of arrays: one by one)
            for (k, v) in keys
                .chunks_exact(4)
                .zip(values.chunks_exact(size_of::<rq_plan>()))
            {
                map.update(k, v, MapFlags::ANY)
                    .context("writing rq_plans")?;
            }
        }
        let bss = skel.maps.bss_data.as_deref_mut().context("no .bss")?;
        let disks: Vec<(u32, String)> = disks.into_iter().take(max_disks).collect();
        for (slot, (dev, _)) in bss.rq_disk_devs.iter_mut().zip(&disks) {
            *slot = *dev;
        }
        Ok(RqHist {
            stages: plans.stages,
            disks,
            rows: RowDiff::default(),
            sums: vec![0; rows],
            summarized: 0,
        })
    }

    /// The disks with rows, by name.
    pub fn disk_names(&self) -> Vec<&str> {
        self.disks.iter().map(|d| d.1.as_str()).collect()
    }

    /// What the kernel counted since the last call into the sink's tables;
    /// `summarized`: the `rq_summarized` counter now.
    pub fn take(&mut self, skel: &ViotraceGuestSkel<'_>, summarized: u64, sink: &mut Sink) {
        let Some(bss) = skel.maps.bss_data.as_deref() else {
            return;
        };
        sink.rqs_summarized(summarized.wrapping_sub(self.summarized));
        self.summarized = summarized;
        let per_disk = bss.rq_row_counts.len() / bss.rq_disk_devs.len();
        for (row, &count) in bss.rq_row_counts.iter().enumerate() {
            let (disk, local) = (row / per_disk, row % per_disk);
            let (Some((_, name)), Some(stage)) = (self.disks.get(disk), self.stages.get(local))
            else {
                continue;
            };
            if !self.rows.moved(row, count) {
                continue;
            }
            let sum = bss.rq_row_sums[row];
            let slots = self.rows.take(row, count, || read_row(skel, row));
            let gained = sum.wrapping_sub(std::mem::replace(&mut self.sums[row], sum));
            if !slots.is_empty() {
                sink.rq_summary(name, stage.name(), &slots, u128::from(gained));
            }
        }
    }
}

/// Row `row` of `rq_hist`.
fn read_row(skel: &ViotraceGuestSkel<'_>, row: usize) -> Option<Vec<u32>> {
    let v = skel
        .maps
        .rq_hist
        .lookup(&(row as u32).to_ne_bytes(), MapFlags::ANY)
        .ok()??;
    if v.len() != size_of::<rq_hist_row>() {
        return None;
    }
    Some(
        v.chunks_exact(4)
            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_mask_has_a_plan_within_the_kernels_room() {
        let slots = crate::raw::point_slots();
        let p = plans(&slots, STEPS, 16);
        // Every mask without g.syscall_exit and with two anchors or more.
        let exit = slots
            .iter()
            .position(|s| *s == Some(Point::SyscallExit))
            .unwrap();
        let want = (0u32..1 << slots.len())
            .filter(|m| m & 1 << exit == 0)
            .filter(|&m| {
                let pts: Vec<Point> = (0..slots.len())
                    .filter(|i| m & 1 << i != 0)
                    .filter_map(|i| slots[i])
                    .collect();
                !point_plan(&pts).is_empty()
            })
            .count();
        assert_eq!(p.masks.len(), want);
        assert!(p.stages.len() <= 16, "{:?}", p.stages);
        // The full guest path: five stages and the total.
        let full: u32 = (0..slots.len() as u32)
            .filter(|&i| i as usize != exit)
            .map(|i| 1 << i)
            .sum();
        let (_, steps) = p.masks.iter().find(|(m, _)| *m == full).unwrap();
        let names: Vec<&str> = steps
            .iter()
            .map(|s| p.stages[s.2 as usize].name())
            .collect();
        assert_eq!(
            names,
            [
                "guest_fs",
                "guest_queue",
                "guest_driver",
                "device",
                "guest_complete",
                "total"
            ]
        );
    }

    #[test]
    fn a_plan_short_of_room_is_left_out_not_cut() {
        let slots = crate::raw::point_slots();
        let p = plans(&slots, 3, 16);
        assert!(p.masks.iter().all(|(_, s)| s.len() <= 3));
        let few = plans(&slots, STEPS, 2);
        assert!(few.stages.len() <= 2);
        assert!(few.masks.iter().all(|(_, s)| s.iter().all(|x| x.2 < 2)));
        assert!(few.masks.len() < p.masks.len() || p.masks.is_empty());
    }

    /// `rq_slot` of bpf/guest/guest_rq_stats.h, transcribed step by step.
    fn bpf_rq_slot(ns: u64) -> u64 {
        let log2_byte = |b: u64| {
            if b == 0 {
                0
            } else {
                63 - b.leading_zeros() as u64
            }
        };
        let ns = ns + ((ns.wrapping_sub(1)) >> 63);
        let mut v = ns | 255;
        let s = (((v >> 16) + 0xffff) >> 16) << 4;
        v >>= s;
        let mut r = s;
        let s = (((v >> 8) + 0xff) >> 8) << 3;
        v >>= s;
        r += s + log2_byte(v & 255) - 7;
        ((r + 1) << 7) + (ns >> r) - 128
    }

    #[test]
    fn the_kernels_branch_free_slot_is_the_tables() {
        use viotrace_shared::stats::hist_slot;
        for e in 0..31u32 {
            let v = 1u64 << e;
            for x in [v - 1, v, v + 1, v + v / 3, (v << 1) - 1] {
                assert_eq!(bpf_rq_slot(x) as usize, hist_slot(x), "{x}");
            }
        }
        assert!(bpf_rq_slot((1 << 31) - 1) < 3200);
    }

    #[test]
    fn the_plan_struct_is_filled_in_order() {
        let b = plan_bytes(&bpf_plan(&[(0, 1, 2), (3, 4, 5)]));
        assert_eq!(b.len(), size_of::<rq_plan>());
        assert_eq!(b[0], 2);
        assert_eq!(&b[1..3], &[0, 3]);
        assert_eq!(&b[1 + STEPS..3 + STEPS], &[1, 4]);
        assert_eq!(&b[1 + 2 * STEPS..3 + 2 * STEPS], &[2, 5]);
    }

    #[test]
    fn disks_virtio_first_filter_honoured() {
        let d = tempfile::tempdir().unwrap();
        for (n, dev) in [
            ("sda", "8:0"),
            ("vdb", "254:16"),
            ("vda", "254:0"),
            ("loop0", "7:0"),
        ] {
            std::fs::create_dir(d.path().join(n)).unwrap();
            std::fs::write(d.path().join(n).join("dev"), format!("{dev}\n")).unwrap();
        }
        let all = pick_disks(d.path(), None, 4);
        let names: Vec<&str> = all.iter().map(|x| x.1.as_str()).collect();
        assert_eq!(names, ["vda", "vdb", "sda"]);
        assert_eq!(all[1].0, 254 << 20 | 16);
        assert_eq!(pick_disks(d.path(), None, 1).len(), 1);
        let only = pick_disks(d.path(), Some((8, 0)), 4);
        assert_eq!(only, vec![(8 << 20, "sda".to_string())]);
    }
}
