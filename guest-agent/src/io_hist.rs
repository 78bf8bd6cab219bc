//! The syscalls that sent no record: their latencies, counted by the BPF side
//! in the stage histograms' bucket layout (`io_rows` in .bss for the common
//! slots, `io_hist` for the rest, `io_sum`; see `sys_summarized` in
//! bpf/guest/guest_io_summary.h), read once an interval.

use std::collections::HashMap;
use std::sync::atomic::{compiler_fence, Ordering};

use libbpf_rs::{MapCore, MapFlags};

/// Key of `io_hist`: syscall number and slot (`IO_HIST_KEY` in the BPF code).
fn split_key(key: u32) -> (u32, usize) {
    (key >> 16, (key & 0xffff) as usize)
}

/// What one syscall number gained since the previous read.
#[derive(Debug, Default, PartialEq)]
pub struct Gained {
    /// (slot, count) pairs.
    pub slots: Vec<(usize, u64)>,
    /// Sum of those latencies, ns.
    pub sum_ns: u128,
}

impl Gained {
    pub fn count(&self) -> u64 {
        self.slots.iter().map(|s| s.1).sum()
    }
}

/// The kernel's `io_rows` (.bss), as the skeleton maps them: row `i` counts
/// syscall `nrs[i]` by slot, `counts[i]` is what it holds (incremented after
/// the slot), `hashed` what went to `io_hist` instead (likewise).
pub struct Rows<'a> {
    pub nrs: &'a [u32],
    pub rows: &'a [[u32; ROW_SLOTS]],
    pub counts: &'a [u64],
    pub hashed: u64,
}

/// Slots per row (`IO_ROW_SLOTS`).
pub const ROW_SLOTS: usize = 3200;

/// The kernel's totals as last read (the maps only grow; the difference is new).
#[derive(Default)]
pub struct IoHist {
    counts: HashMap<u32, u64>,
    sums: HashMap<u32, u64>,
    /// Each row's total and counts as last read (a row gets its copy when
    /// its total first moves).
    rows: HashMap<usize, (u64, Vec<u32>)>,
    /// Batch reads that came up short and were done again key by key.
    pub batch_short: u64,
    /// `hashed` of the last read of `io_hist`: unchanged, nothing new went
    /// there, and it is not read (a batch read walks every bucket).
    last_hashed: u64,
}

impl IoHist {
    /// What the kernel counted since the previous call, by syscall number:
    /// the rows, then `hist` (`IO_HIST_KEY(nr, slot)` → count) when
    /// `rows.hashed` moved. `sum` is indexed by syscall number.
    pub fn take(
        &mut self,
        rows: &Rows<'_>,
        hist: &dyn MapCore,
        sum: &dyn MapCore,
    ) -> HashMap<u32, Gained> {
        let mut now = Vec::new();
        if rows.hashed != self.last_hashed {
            now = self.read_hist(hist, rows.hashed);
            self.last_hashed = rows.hashed;
        }
        let mut out = self.gained(now);
        self.take_rows(rows, &mut out);
        self.add_sums(&mut out, |nr| {
            sum.lookup(&nr.to_ne_bytes(), MapFlags::ANY)
                .ok()
                .flatten()
                .and_then(|v| ne_u64(&v))
        });
        out
    }

    /// The rows whose count moved, against their last read.
    fn take_rows(&mut self, rows: &Rows<'_>, out: &mut HashMap<u32, Gained>) {
        for (i, (&count, row)) in rows.counts.iter().zip(rows.rows).enumerate() {
            let Some(&nr) = rows.nrs.get(i) else { break };
            if count == self.rows.get(&i).map_or(0, |r| r.0) {
                continue;
            }
            let (seen, prev) = self
                .rows
                .entry(i)
                .or_insert_with(|| (0, vec![0; ROW_SLOTS]));
            // The count first: each slot is incremented before it.
            *seen = count;
            compiler_fence(Ordering::SeqCst);
            let mut slots = Vec::new();
            for (slot, (&v, p)) in row.iter().zip(prev.iter_mut()).enumerate() {
                if v != *p {
                    slots.push((slot, u64::from(v.wrapping_sub(*p))));
                    *p = v;
                }
            }
            if !slots.is_empty() {
                out.entry(nr).or_default().slots.extend(slots);
            }
        }
    }

    /// `io_hist`'s (key, count) pairs; `at_least`: what it must hold.
    fn read_hist(&mut self, hist: &dyn MapCore, at_least: u64) -> Vec<(u32, u64)> {
        // A batch covers every slot in use (at most IO_HIST_MAX) in a few
        // calls. Its iterator ends quietly on an error, so a read that comes
        // up short of `at_least` is done again key by key.
        let pair = |(k, v): (Vec<u8>, Vec<u8>)| Some((ne_u32(&k)?, ne_u64(&v)?));
        let mut now: Vec<(u32, u64)> = match hist.lookup_batch(1024, MapFlags::ANY, MapFlags::ANY) {
            Ok(it) => it.filter_map(pair).collect(),
            Err(_) => Vec::new(),
        };
        if now.iter().map(|e| e.1).sum::<u64>() < at_least {
            self.batch_short += 1;
            now = hist
                .keys()
                .filter_map(|k| {
                    let v = hist.lookup(&k, MapFlags::ANY).ok()??;
                    pair((k, v))
                })
                .collect();
        }
        now
    }

    /// The difference between `now` (key → count) and the previous read.
    fn gained(&mut self, now: Vec<(u32, u64)>) -> HashMap<u32, Gained> {
        let mut out: HashMap<u32, Gained> = HashMap::new();
        for (key, count) in now {
            let prev = self.counts.insert(key, count).unwrap_or(0);
            let d = count.wrapping_sub(prev);
            if d > 0 {
                let (nr, slot) = split_key(key);
                out.entry(nr).or_default().slots.push((slot, d));
            }
        }
        out
    }

    /// Each gaining syscall's latency sum from `sum_of`, differenced likewise.
    fn add_sums(&mut self, out: &mut HashMap<u32, Gained>, sum_of: impl Fn(u32) -> Option<u64>) {
        for (nr, g) in out.iter_mut() {
            if let Some(s) = sum_of(*nr) {
                let prev = self.sums.insert(*nr, s).unwrap_or(0);
                g.sum_ns = u128::from(s.wrapping_sub(prev));
            }
        }
    }
}

fn ne_u32(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

fn ne_u64(b: &[u8]) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(..8)?.try_into().ok()?))
}

/// `hist_slot` of bpf/guest/guest_io_summary.h, transcribed step by step (its
/// `log2_u64` has no count of leading zeros to use).
#[cfg(test)]
fn bpf_hist_slot(ns: u64) -> usize {
    fn log2_u64(mut v: u64) -> u32 {
        let mut r = 0;
        for sh in [32, 16, 8, 4, 2] {
            if v >> sh != 0 {
                v >>= sh;
                r += sh;
            }
        }
        r + (v >> 1) as u32
    }
    let bucket = log2_u64(ns | 255) - 7;
    (((bucket + 1) << 7) + (ns >> bucket) as u32 - 128) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use viotrace_shared::stats::hist_slot;

    #[test]
    fn the_bpf_slot_is_the_agents() {
        // Every power of two below 2^41 (the BPF side's limit) and its neighbours.
        for e in 0..41u32 {
            let v = 1u64 << e;
            for x in [v, v + 1, v + v / 3, (v << 1) - 1] {
                assert_eq!(bpf_hist_slot(x), hist_slot(x), "{x}");
            }
        }
        assert!(bpf_hist_slot((1 << 41) - 1) < 0xffff);
    }

    #[test]
    fn only_what_was_gained_is_handed_on() {
        let mut h = IoHist::default();
        let key = |nr: u32, slot: u32| nr << 16 | slot;
        let mut first = h.gained(vec![(key(17, 300), 5), (key(17, 301), 1)]);
        h.add_sums(&mut first, |_| Some(900));
        assert_eq!(first[&17].slots, vec![(300, 5), (301, 1)]);
        assert_eq!((first[&17].count(), first[&17].sum_ns), (6, 900));
        // Nothing new in slot 300, 2 more in 301, a new syscall.
        let mut second = h.gained(vec![(key(17, 300), 5), (key(17, 301), 3), (key(0, 4), 1)]);
        h.add_sums(&mut second, |nr| Some(if nr == 17 { 1000 } else { 7 }));
        assert_eq!(second[&17].slots, vec![(301, 2)]);
        assert_eq!(second[&17].sum_ns, 100);
        assert_eq!((second[&0].count(), second[&0].sum_ns), (1, 7));
        assert!(h.gained(vec![(key(17, 301), 3)]).is_empty());
    }

    #[test]
    fn rows_hand_on_what_moved_and_merge_with_the_hash() {
        let mut h = IoHist::default();
        let mut rows = vec![[0u32; ROW_SLOTS]; 3];
        let nrs = [0u32, 17, 209];
        rows[1][300] = 4;
        rows[1][3199] = 1;
        let mut r = |rows: &[[u32; ROW_SLOTS]], counts: &[u64]| {
            let mut out = h.gained(vec![(17 << 16 | 5000, 2)]);
            h.take_rows(
                &Rows {
                    nrs: &nrs,
                    rows,
                    counts,
                    hashed: 0,
                },
                &mut out,
            );
            out
        };
        let first = r(&rows, &[0, 5, 0]);
        let mut slots = first[&17].slots.clone();
        slots.sort();
        assert_eq!(slots, vec![(300, 4), (3199, 1), (5000, 2)]);
        assert_eq!(first.len(), 1);
        // Row 1 unchanged and its count too: nothing; row 2 moved.
        rows[2][10] = 1;
        let second = r(&rows, &[0, 5, 1]);
        assert_eq!(second[&209].slots, vec![(10, 1)]);
        assert!(!second.contains_key(&17));
        // A slot incremented before its count: taken when the count moves.
        rows[1][300] = 6;
        assert!(r(&rows, &[0, 5, 1]).is_empty());
        assert_eq!(r(&rows, &[0, 7, 1])[&17].slots, vec![(300, 2)]);
        // A 32-bit slot that wrapped between two reads: its difference.
        rows[1][300] = u32::MAX;
        assert_eq!(
            r(&rows, &[0, 8, 1])[&17].slots,
            vec![(300, u64::from(u32::MAX - 6))]
        );
        rows[1][300] = 2;
        assert_eq!(r(&rows, &[0, 11, 1])[&17].slots, vec![(300, 3)]);
    }
}
