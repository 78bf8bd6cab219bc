//! A stage's recent baseline: the last [`WINDOW`] values, median on demand.

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
