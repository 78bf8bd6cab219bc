//! The request table counted in the kernel (bpf/guest/guest_rq_table.h):
//! always-on with nothing but the tables reading request records, a finished
//! request's stages are counted by the BPF side, which this module tells what
//! to count and reads once an interval.
//!
//! What to count is learned from the records that still come: a request of a
//! disk, or with a set of points, the kernel has no plan for sends its record
//! (the tables get it as before), and [`RqTable::learn`] then sets up the
//! disk, the plan of its points (the stages [`counted_stages`] names: exactly
//! those the statistics record for such a record) and a row per (disk,
//! stage), so that the next request like it is counted in the kernel. The
//! counts come back by row as slots of the statistics' own bucket layout and
//! a sum, which [`viotrace_shared::stats::Aggregator::record_slots`] adds as
//! if it had had each record.

use std::collections::{HashMap, HashSet};

use viotrace_shared::record::{Point, Points};
use viotrace_shared::stages::counted_stages;

use crate::bpf::types::{rq_plan, rq_row};

/// Disks the kernel can count for (`RQ_TABLE_DISKS`).
pub const DISKS: usize = 4;
/// Rows of counters (`RQ_TABLE_ROWS`).
pub const ROWS: usize = 32;
/// Points of a record's `ts[]` (`P_NR`): a plan's key is a disk index and a
/// mask of this many bits.
const P_NR: u32 = 12;

/// Steps of a plan (`RQ_PLAN_STEPS`), as the generated type has them.
fn plan_steps() -> usize {
    rq_plan::default().from.len()
}

/// Slots per row (`RQ_ROW_SLOTS`).
pub fn row_slots() -> usize {
    (std::mem::size_of::<rq_row>() - 8) / 4
}

/// A write for the kernel's maps, as `rq_table_devs` / `rq_plans` take it.
#[derive(Debug, PartialEq)]
pub enum Write {
    /// Entry 0 of `rq_table_devs`: every disk index's dev_t.
    Disks(Vec<u8>),
    /// Entry `key` of `rq_plans`.
    Plan { key: u32, value: Vec<u8> },
}

/// One row's gain since the last read: the disk's name, the stage, its
/// (slot, count) pairs and their sum.
#[derive(Debug, PartialEq)]
pub struct Gain {
    pub disk: String,
    pub stage: &'static str,
    pub slots: Vec<(usize, u64)>,
    pub sum_ns: u128,
}

struct Row {
    disk: usize,
    stage: &'static str,
    /// The counts and sum as last read (32-bit counts wrap; differences do not).
    prev: Vec<u32>,
    sum: u64,
}

/// What the kernel was told, and what was read back.
pub struct RqTable {
    /// The point of each `ts[]` slot, and the slot of each point.
    c_point: Vec<Option<Point>>,
    c_slot: HashMap<Point, u8>,
    /// The dev_t of each disk index (0: free), and its name.
    devs: [u32; DISKS],
    names: [String; DISKS],
    /// Plan keys already written, or found impossible (not written again).
    planned: HashSet<u32>,
    rows: Vec<Row>,
    row_of: HashMap<(usize, &'static str), u8>,
    /// Requests counted per disk index, as last read.
    counts: [u64; DISKS],
    /// Set-ups that found no disk index or row left (or a write that
    /// failed): those requests keep sending their records.
    pub refused: u64,
    /// Requests counted by the kernel, read so far.
    pub summarized: u64,
}

impl RqTable {
    /// `c_points[i]`: the point of `ts[i]` (raw.rs's slot map).
    pub fn new(c_points: &[Option<Point>]) -> Self {
        let c_slot = c_points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some(((*p)?, i as u8)))
            .collect();
        RqTable {
            c_point: c_points.to_vec(),
            c_slot,
            devs: [0; DISKS],
            names: Default::default(),
            planned: HashSet::new(),
            rows: Vec::new(),
            row_of: HashMap::new(),
            counts: [0; DISKS],
            refused: 0,
            summarized: 0,
        }
    }

    /// The disk index of `dev`, given one if need be (with the write).
    fn disk(&mut self, dev: u32, name: String, out: &mut Vec<Write>) -> Option<usize> {
        if let Some(i) = self.devs.iter().position(|&d| d == dev) {
            return Some(i);
        }
        let i = self.devs.iter().position(|&d| d == 0)?;
        self.devs[i] = dev;
        self.names[i] = name;
        out.push(Write::Disks(
            self.devs.iter().flat_map(|d| d.to_ne_bytes()).collect(),
        ));
        Some(i)
    }

    /// The row of (disk, stage), given one if need be; its number + 1.
    fn row(&mut self, disk: usize, stage: &'static str) -> Option<u8> {
        if let Some(&r) = self.row_of.get(&(disk, stage)) {
            return Some(r);
        }
        if self.rows.len() >= ROWS {
            return None;
        }
        self.rows.push(Row {
            disk,
            stage,
            prev: vec![0; row_slots()],
            sum: 0,
        });
        let r = self.rows.len() as u8;
        self.row_of.insert((disk, stage), r);
        Some(r)
    }

    /// A request record of disk `dev` (named `name`) whose `ts[]` had mask `mask` came: the
    /// kernel had no plan for it (or one of its stages was too long for a
    /// row). Returns the writes that set it up, none when already done.
    pub fn learn(&mut self, dev: u32, mask: u32, name: String) -> Vec<Write> {
        let mut out = Vec::new();
        if dev == 0 || mask >> P_NR != 0 {
            return out;
        }
        let known = self.devs.iter().position(|&d| d == dev);
        if known.is_some_and(|i| self.planned.contains(&key(i, mask))) {
            return out;
        }
        let Some(disk) = self.disk(dev, name, &mut out) else {
            self.refused += 1;
            return out;
        };
        let k = key(disk, mask);
        self.planned.insert(k);
        // The stages a record with these points counts, in `ts[]` slots.
        let mut ts = Points::new();
        for (i, p) in self.c_point.iter().enumerate() {
            if let Some(p) = p.filter(|_| mask & (1 << i) != 0) {
                ts.set(p, 1);
            }
        }
        let stages = counted_stages(&ts);
        if stages.is_empty() || stages.len() > plan_steps() {
            return out;
        }
        let mut plan = rq_plan {
            n: stages.len() as u8,
            ..Default::default()
        };
        for (i, (stage, a, b)) in stages.into_iter().enumerate() {
            let (Some(&from), Some(&to)) = (self.c_slot.get(&a), self.c_slot.get(&b)) else {
                return out;
            };
            let Some(row) = self.row(disk, stage) else {
                self.refused += 1;
                return out;
            };
            (plan.from[i], plan.to[i], plan.row[i]) = (from, to, row);
        }
        out.push(Write::Plan {
            key: k,
            value: plan_bytes(&plan),
        });
        out
    }

    /// What the kernel counted since the last call: `counts` is the BPF
    /// side's `rq_table_counts`, `read_row(r)` entry `r` of `rq_rows`.
    /// Returns the requests counted and each row's gain.
    pub fn take(
        &mut self,
        counts: &[u64],
        read_row: impl Fn(u32) -> Option<Vec<u8>>,
    ) -> (u64, Vec<Gain>) {
        let mut moved = [false; DISKS];
        let mut requests = 0;
        for (i, (&now, last)) in counts.iter().zip(self.counts.iter_mut()).enumerate() {
            moved[i] = now != *last;
            requests += now.wrapping_sub(*last);
            *last = now;
        }
        self.summarized += requests;
        // (each request's rows are counted before its disk's count: a row
        // read after its count moved holds at least those requests)
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let mut gains = Vec::new();
        for (r, row) in self.rows.iter_mut().enumerate() {
            if !moved[row.disk] {
                continue;
            }
            let Some(b) = read_row(r as u32) else {
                continue;
            };
            let Some((sum, counts)) = parse_row(&b) else {
                continue;
            };
            let mut slots = Vec::new();
            for (slot, (v, p)) in counts.zip(row.prev.iter_mut()).enumerate() {
                if v != *p {
                    slots.push((slot, u64::from(v.wrapping_sub(*p))));
                    *p = v;
                }
            }
            let sum_ns = u128::from(sum.wrapping_sub(row.sum));
            row.sum = sum;
            if !slots.is_empty() {
                gains.push(Gain {
                    disk: self.names[row.disk].clone(),
                    stage: row.stage,
                    slots,
                    sum_ns,
                });
            }
        }
        (requests, gains)
    }
}

/// Key of `rq_plans`: disk index and mask.
fn key(disk: usize, mask: u32) -> u32 {
    (disk as u32) << P_NR | mask
}

/// `struct rq_plan` as the map takes it (u8 fields only: no padding).
fn plan_bytes(p: &rq_plan) -> Vec<u8> {
    let mut v = vec![p.n];
    v.extend_from_slice(&p.from);
    v.extend_from_slice(&p.to);
    v.extend_from_slice(&p.row);
    debug_assert_eq!(v.len(), std::mem::size_of::<rq_plan>());
    v
}

/// `struct rq_row` from the map: the sum, then the counts by slot.
fn parse_row(b: &[u8]) -> Option<(u64, impl Iterator<Item = u32> + '_)> {
    if b.len() != std::mem::size_of::<rq_row>() {
        return None;
    }
    let sum = u64::from_ne_bytes(b[..8].try_into().ok()?);
    let counts = b[8..]
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]));
    Some((sum, counts))
}

#[cfg(test)]
#[path = "rq_table_tests.rs"]
mod tests;
