//! The guest sender's buffer of encoded records, in blocks. A record is copied
//! once, into the open block; a batch is a frame head and slices of sealed
//! blocks, which the writer sends from where they lie (vectored writes),
//! without the queue's lock and without copying them into a frame first (that
//! copy, a `rep movsb` of every byte sent, was about 270 guest instructions
//! per request record under TCG). Buffering a record allocates nothing: blocks
//! are reused.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use crate::proto::batch_header;

/// Bytes of an open block before a record that does not fit seals it (a
/// record larger than this gets a block of its own).
pub(crate) const BLOCK: usize = 16 * 1024;
/// An open block sealed with fewer bytes than this is copied into a block of
/// its own size, and the open one keeps its allocation: a sealed block takes
/// at most twice the bytes it holds.
const COPY_BELOW: usize = BLOCK / 2;
/// Emptied blocks kept for reuse.
const SPARE: usize = 8;

/// Bytes of records that no longer change, `start..` of them still held.
struct Sealed {
    data: Arc<Vec<u8>>,
    start: usize,
}

/// One batch frame: its head, then its records' bytes in pieces of sealed
/// blocks (shared with the ring: the writer holds them without the lock).
pub(crate) struct Batch {
    pub head: Vec<u8>,
    pub pieces: Vec<(Arc<Vec<u8>>, Range<usize>)>,
}

impl Batch {
    /// The frame's bytes in order.
    pub fn slices(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(self.head.as_slice()).chain(self.pieces.iter().map(|(b, r)| &b[r.clone()]))
    }
}

/// Encoded records, oldest first, with a send cursor: the records before it
/// were written on the current connection. Their bytes are the sealed blocks'
/// held bytes, then the open block's.
#[derive(Default)]
pub(crate) struct RecordRing {
    sealed: VecDeque<Sealed>,
    open: Vec<u8>,
    lens: VecDeque<u32>,
    bytes: usize,
    /// Records before the cursor, and their bytes.
    sent: usize,
    sent_bytes: usize,
    spare: Vec<Vec<u8>>,
}

impl RecordRing {
    /// Records held.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Records before the cursor.
    pub fn sent(&self) -> usize {
        self.sent
    }

    /// Records after the cursor.
    pub fn unsent(&self) -> usize {
        self.lens.len() - self.sent
    }

    /// Appends one encoded record (at most `u32::MAX` bytes: frames are far smaller).
    pub fn push(&mut self, rec: &[u8]) {
        if !self.open.is_empty() && self.open.len() + rec.len() > BLOCK {
            self.seal();
        }
        if self.open.capacity() == 0 {
            self.open = self
                .spare
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(BLOCK));
        }
        self.open.extend_from_slice(rec);
        self.lens.push_back(rec.len() as u32);
        self.bytes += rec.len();
    }

    /// Makes the open block's records a sealed block.
    fn seal(&mut self) {
        if self.open.is_empty() {
            return;
        }
        let data = if self.open.len() < COPY_BELOW {
            let small = self.open.clone();
            self.open.clear();
            small
        } else {
            std::mem::take(&mut self.open)
        };
        self.sealed.push_back(Sealed {
            data: Arc::new(data),
            start: 0,
        });
    }

    /// Keeps an emptied block for reuse, unless a writer still holds it.
    fn recycle(&mut self, data: Arc<Vec<u8>>) {
        if let Ok(mut v) = Arc::try_unwrap(data) {
            if v.capacity() == BLOCK && self.spare.len() < SPARE {
                v.clear();
                self.spare.push(v);
            }
        }
    }

    /// Forgets the `n` oldest records (acknowledged). The cursor stays on the
    /// same record, or moves to the new oldest one if that was among them.
    pub fn pop_front(&mut self, n: usize) {
        let n = n.min(self.lens.len());
        let mut bytes: usize = self.lens.drain(..n).map(|l| l as usize).sum();
        self.bytes -= bytes;
        if self.sent >= n {
            self.sent -= n;
            self.sent_bytes -= bytes;
        } else {
            self.sent = 0;
            self.sent_bytes = 0;
        }
        while bytes > 0 {
            let Some(s) = self.sealed.front_mut() else {
                // (not sealed yet: records acknowledged before they were written)
                self.open.drain(..bytes);
                break;
            };
            let held = s.data.len() - s.start;
            if bytes < held {
                s.start += bytes;
                break;
            }
            bytes -= held;
            if let Some(s) = self.sealed.pop_front() {
                self.recycle(s.data);
            }
        }
    }

    /// Moves the cursor back to the oldest record: all of them go again.
    pub fn rewind(&mut self) {
        self.sent = 0;
        self.sent_bytes = 0;
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        while let Some(s) = self.sealed.pop_front() {
            self.recycle(s.data);
        }
        self.open.clear();
        self.lens.clear();
        self.bytes = 0;
        self.rewind();
    }

    /// The batch frame of the next unsent records, numbered from `first_seq`:
    /// at most `max_n`, and at most `max_bytes` of records unless the first
    /// alone is larger. Moves the cursor past them; `None` when none is unsent.
    pub fn next_batch(&mut self, first_seq: u64, max_n: usize, max_bytes: usize) -> Option<Batch> {
        let (mut n, mut bytes) = (0, 0);
        for &l in self.lens.range(self.sent..) {
            let l = l as usize;
            if n == max_n || (n > 0 && bytes + l > max_bytes) {
                break;
            }
            n += 1;
            bytes += l;
        }
        if n == 0 {
            return None;
        }
        let to = self.sent_bytes + bytes;
        if to > self.bytes - self.open.len() {
            self.seal();
        }
        let mut head = Vec::with_capacity(32);
        batch_header(first_seq, n, bytes, &mut head);
        let (mut skip, mut left) = (self.sent_bytes, bytes);
        let mut pieces = Vec::new();
        for s in &self.sealed {
            let held = s.data.len() - s.start;
            if skip >= held {
                skip -= held;
                continue;
            }
            let from = s.start + skip;
            let take = (held - skip).min(left);
            pieces.push((s.data.clone(), from..from + take));
            left -= take;
            skip = 0;
            if left == 0 {
                break;
            }
        }
        debug_assert_eq!(left, 0, "the sealed blocks hold every sent record");
        self.sent += n;
        self.sent_bytes = to;
        Some(Batch { head, pieces })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::batch_frame;

    fn frame(b: &Batch) -> Vec<u8> {
        b.slices().flatten().copied().collect()
    }

    /// Records of varied sizes (some larger than a block) through pushes,
    /// partial acks, rewinds and sealed blocks: every batch is the proto's
    /// frame of exactly the records it names, in order.
    #[test]
    fn batches_hold_the_pushed_records_across_acks_rewinds_and_blocks() {
        let rec = |i: u64| -> Vec<u8> {
            let len = if i % 97 == 5 {
                BLOCK + 300
            } else {
                1 + (i as usize * 677) % 3000
            };
            vec![i as u8; len]
        };
        let mut r = RecordRing::default();
        let (mut base, mut next) = (0u64, 0u64);
        let mut held_batches = Vec::new();
        for round in 0..300u64 {
            for _ in 0..(3 + round % 17) {
                r.push(&rec(next));
                next += 1;
            }
            assert_eq!(r.len() as u64, next - base);
            let first = base + r.sent() as u64;
            let max_bytes = if round % 5 == 0 { 100 } else { 40_000 };
            let Some(b) = r.next_batch(first, 4 + round as usize % 9, max_bytes) else {
                panic!("round {round}: records were unsent");
            };
            let n = r.sent() as u64 + base - first;
            let mut want = Vec::new();
            let recs: Vec<Vec<u8>> = (first..first + n).map(rec).collect();
            batch_frame(first, n as usize, recs.iter().map(Vec::as_slice), &mut want);
            assert_eq!(frame(&b), want, "round {round}");
            // A writer may still hold a batch while acks free its blocks.
            held_batches.push((b, want));
            if held_batches.len() > 3 {
                let (b, want) = held_batches.remove(0);
                assert_eq!(frame(&b), want, "a held batch changed (round {round})");
            }
            let acked = (r.sent() / 2) as u64;
            r.pop_front(acked as usize);
            base += acked;
            if round % 7 == 3 {
                r.rewind();
            }
            let held: usize = (base..next).map(|i| rec(i).len()).sum();
            assert_eq!(r.bytes(), held);
            let in_blocks: usize = r.sealed.iter().map(|s| s.data.len() - s.start).sum();
            assert_eq!(in_blocks + r.open.len(), held, "round {round}");
        }
        r.clear();
        assert_eq!((r.len(), r.bytes(), r.unsent()), (0, 0, 0));
        assert!(r.next_batch(next, 10, 100).is_none());
    }

    #[test]
    fn a_record_larger_than_the_byte_limit_goes_alone() {
        let mut r = RecordRing::default();
        r.push(&[1; 300]);
        r.push(&[2; 10]);
        let n = |r: &mut RecordRing, seq| {
            let before = r.sent();
            r.next_batch(seq, 10, 100).map(|_| r.sent() - before)
        };
        assert_eq!(n(&mut r, 0), Some(1));
        assert_eq!(n(&mut r, 1), Some(1));
        assert_eq!(n(&mut r, 2), None);
        assert_eq!(r.unsent(), 0);
    }

    /// Records acknowledged before they were written (a host acking ahead)
    /// leave the rest intact.
    #[test]
    fn acks_of_unsealed_records_keep_the_rest() {
        let mut r = RecordRing::default();
        for i in 0..5u8 {
            r.push(&[i; 10]);
        }
        r.pop_front(2);
        let b = r.next_batch(2, 10, 1000).expect("three unsent");
        let mut want = Vec::new();
        batch_frame(2, 3, [&[2u8; 10][..], &[3; 10], &[4; 10]], &mut want);
        assert_eq!(frame(&b), want);
    }

    /// Steady traffic with prompt acks reuses its blocks.
    #[test]
    fn blocks_are_reused() {
        let mut r = RecordRing::default();
        for seq in 0..10_000u64 {
            r.push(&[7; 200]);
            if seq % 100 == 99 {
                let first = seq - 99;
                let b = r.next_batch(first, 1000, 1 << 20).expect("unsent");
                drop(b);
                r.pop_front(100);
            }
        }
        assert!(r.spare.len() <= SPARE && !r.spare.is_empty());
        assert_eq!(r.bytes(), 0);
    }
}
