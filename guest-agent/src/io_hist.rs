//! The syscalls that sent no record: their latencies, counted by the BPF side
//! in the stage histograms' bucket layout (`io_hist`, `io_sum`; see
//! `sys_summarized` in bpf/guest/guest_task.h), read once an interval.

use std::collections::HashMap;

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

/// The kernel's totals as last read (the maps only grow; the difference is new).
#[derive(Default)]
pub struct IoHist {
    counts: HashMap<u32, u64>,
    sums: HashMap<u32, u64>,
    /// Batch reads that came up short and were done again key by key.
    pub batch_short: u64,
    /// `at_least` of the last read: unchanged, nothing new was summarized
    /// (each syscall is in the maps before it is counted), and the maps are
    /// not read (a batch read walks every bucket of `io_hist`).
    last_at_least: u64,
}

impl IoHist {
    /// What the kernel counted since the previous call, by syscall number.
    /// `hist` maps `IO_HIST_KEY(nr, slot)` to a count, `sum` is indexed by
    /// syscall number. `at_least`: the kernel's count of summarized syscalls,
    /// read before (each is in `hist` before it is counted there).
    pub fn take(
        &mut self,
        hist: &dyn MapCore,
        sum: &dyn MapCore,
        at_least: u64,
    ) -> HashMap<u32, Gained> {
        if at_least == self.last_at_least {
            return HashMap::new();
        }
        self.last_at_least = at_least;
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
        self.gained(now, |nr| {
            sum.lookup(&nr.to_ne_bytes(), MapFlags::ANY)
                .ok()
                .flatten()
                .and_then(|v| ne_u64(&v))
        })
    }

    /// The difference between `now` (key → count) and the previous read,
    /// with each syscall's latency sum from `sum_of` (differenced likewise).
    fn gained(
        &mut self,
        now: Vec<(u32, u64)>,
        sum_of: impl Fn(u32) -> Option<u64>,
    ) -> HashMap<u32, Gained> {
        let mut out: HashMap<u32, Gained> = HashMap::new();
        for (key, count) in now {
            let prev = self.counts.insert(key, count).unwrap_or(0);
            let d = count.wrapping_sub(prev);
            if d > 0 {
                let (nr, slot) = split_key(key);
                out.entry(nr).or_default().slots.push((slot, d));
            }
        }
        for (nr, g) in out.iter_mut() {
            if let Some(s) = sum_of(*nr) {
                let prev = self.sums.insert(*nr, s).unwrap_or(0);
                g.sum_ns = u128::from(s.wrapping_sub(prev));
            }
        }
        out
    }
}

fn ne_u32(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

fn ne_u64(b: &[u8]) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(..8)?.try_into().ok()?))
}

/// `hist_slot` of bpf/guest/guest_task.h, transcribed step by step (its
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
        let first = h.gained(vec![(key(17, 300), 5), (key(17, 301), 1)], |_| Some(900));
        assert_eq!(first[&17].slots, vec![(300, 5), (301, 1)]);
        assert_eq!((first[&17].count(), first[&17].sum_ns), (6, 900));
        // Nothing new in slot 300, 2 more in 301, a new syscall.
        let second = h.gained(
            vec![(key(17, 300), 5), (key(17, 301), 3), (key(0, 4), 1)],
            |nr| Some(if nr == 17 { 1000 } else { 7 }),
        );
        assert_eq!(second[&17].slots, vec![(301, 2)]);
        assert_eq!(second[&17].sum_ns, 100);
        assert_eq!((second[&0].count(), second[&0].sum_ns), (1, 7));
        assert!(h.gained(vec![(key(17, 301), 3)], |_| Some(1000)).is_empty());
    }
}
