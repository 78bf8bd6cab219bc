//! The guest sender's buffer of encoded records: one byte queue and one length
//! per record, so buffering a record allocates nothing (a vector per record
//! cost an allocation, a reallocation and a free, and twice its size in heap).

use std::collections::VecDeque;

use crate::proto::batch_frame;

/// Encoded records, oldest first, with a send cursor: the records before it
/// were written on the current connection.
#[derive(Default)]
pub(crate) struct RecordRing {
    data: VecDeque<u8>,
    lens: VecDeque<u32>,
    /// Records before the cursor, and their bytes.
    sent: usize,
    sent_bytes: usize,
}

impl RecordRing {
    /// Records held.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
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
        self.data.extend(rec);
        self.lens.push_back(rec.len() as u32);
    }

    /// Forgets the `n` oldest records (acknowledged). The cursor stays on the
    /// same record, or moves to the new oldest one if that was among them.
    pub fn pop_front(&mut self, n: usize) {
        let n = n.min(self.lens.len());
        let bytes: usize = self.lens.drain(..n).map(|l| l as usize).sum();
        self.data.drain(..bytes);
        if self.sent >= n {
            self.sent -= n;
            self.sent_bytes -= bytes;
        } else {
            self.sent = 0;
            self.sent_bytes = 0;
        }
    }

    /// Moves the cursor back to the oldest record: all of them go again.
    pub fn rewind(&mut self) {
        self.sent = 0;
        self.sent_bytes = 0;
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.data.clear();
        self.lens.clear();
        self.rewind();
    }

    /// Appends to `out` a batch frame of the next unsent records, numbered from
    /// `first_seq`: at most `max_n`, and at most `max_bytes` of records unless
    /// the first alone is larger. Moves the cursor past them; returns how many.
    pub fn write_batch(
        &mut self,
        first_seq: u64,
        max_n: usize,
        max_bytes: usize,
        out: &mut Vec<u8>,
    ) -> usize {
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
            return 0;
        }
        let (a, b) = self.data.as_slices();
        let (from, to) = (self.sent_bytes, self.sent_bytes + bytes);
        let first = &a[from.min(a.len())..to.min(a.len())];
        let second = &b[from.saturating_sub(a.len())..to.saturating_sub(a.len())];
        batch_frame(first_seq, n, [first, second], out);
        self.sent += n;
        self.sent_bytes = to;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records of varied sizes through pushes, partial acks, rewinds and a
    /// wrapped buffer: every batch holds exactly the records it names, in order.
    #[test]
    fn batches_hold_the_pushed_records_across_acks_rewinds_and_wraps() {
        let rec = |i: u64| -> Vec<u8> { vec![i as u8; 1 + (i as usize * 7) % 40] };
        let mut r = RecordRing::default();
        let (mut base, mut next) = (0u64, 0u64);
        for round in 0..50u64 {
            for _ in 0..(5 + round % 13) {
                r.push(&rec(next));
                next += 1;
            }
            assert_eq!(r.len() as u64, next - base);
            let mut out = Vec::new();
            let first = base + r.sent() as u64;
            let n = r.write_batch(first, 4 + round as usize % 5, 100, &mut out);
            // The frame is the proto's batch of exactly those records.
            let mut want = Vec::new();
            let recs: Vec<Vec<u8>> = (first..first + n as u64).map(rec).collect();
            batch_frame(first, n, recs.iter().map(Vec::as_slice), &mut want);
            assert_eq!(out, want, "round {round}");
            assert!(n >= 1);
            // Ack part of what was sent; sometimes start over (reconnect).
            let acked = (r.sent() / 2) as u64;
            r.pop_front(acked as usize);
            base += acked;
            if round % 7 == 3 {
                r.rewind();
            }
            let held: usize = (base..next).map(|i| rec(i).len()).sum();
            assert_eq!(r.bytes(), held);
        }
        r.clear();
        assert_eq!((r.len(), r.bytes(), r.unsent()), (0, 0, 0));
    }

    #[test]
    fn a_record_larger_than_the_byte_limit_goes_alone() {
        let mut r = RecordRing::default();
        r.push(&[1; 300]);
        r.push(&[2; 10]);
        let mut out = Vec::new();
        assert_eq!(r.write_batch(0, 10, 100, &mut out), 1);
        assert_eq!(r.write_batch(1, 10, 100, &mut out), 1);
        assert_eq!(r.write_batch(2, 10, 100, &mut out), 0);
        assert_eq!(r.unsent(), 0);
    }
}
