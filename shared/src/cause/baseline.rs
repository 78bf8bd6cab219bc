//! A stage's recent baseline: the last [`WINDOW`] values, median on demand.

use super::{MIN_SAMPLES, SLOW_FACTOR};

/// Values kept per stage and class.
pub const WINDOW: usize = 64;

/// A ring of the last [`WINDOW`] values.
#[derive(Clone, Debug, Default)]
pub struct Window {
    vals: Vec<i64>,
    next: usize,
}

impl Window {
    pub fn push(&mut self, v: i64) {
        if self.vals.len() < WINDOW {
            self.vals.push(v);
        } else {
            self.vals[self.next] = v;
        }
        self.next = (self.next + 1) % WINDOW;
    }

    pub fn len(&self) -> usize {
        self.vals.len()
    }

    pub fn is_empty(&self) -> bool {
        self.vals.is_empty()
    }

    /// The rule every verdict starts from: a total is slow against this window
    /// of its class's totals when the window holds [`MIN_SAMPLES`] and the
    /// total reaches both `threshold_ns` and [`SLOW_FACTOR`] × the median.
    /// Returns that median (the baseline) when it is slow.
    pub fn slow_baseline(&self, total_ns: i64, threshold_ns: i64) -> Option<i64> {
        if self.len() < MIN_SAMPLES || total_ns < threshold_ns {
            return None;
        }
        let base = self.median()?;
        ((total_ns as f64) >= SLOW_FACTOR * base.max(1) as f64).then_some(base)
    }

    /// The median (lower middle for an even count); `None` when empty.
    pub fn median(&self) -> Option<i64> {
        if self.vals.is_empty() {
            return None;
        }
        let mut v = self.vals.clone();
        let mid = (v.len() - 1) / 2;
        Some(*v.select_nth_unstable(mid).1)
    }
}
