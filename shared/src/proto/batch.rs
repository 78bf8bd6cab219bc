//! [`Message::Batch`]'s decoder, by hand, in two steps: [`RawBatch::skim`]
//! checks a batch's structure (every record's tag and extent; syscall records
//! are decoded once) and keeps the records' bytes; [`BatchReader`] then
//! decodes the records one at a time into records it keeps and overwrites.
//! The host agent's network thread skims (it needs the count for the
//! sequence accounting), its main thread reads: a request record is decoded
//! once, and none is built, moved or stored per I/O on the way (a syscall
//! record, rare, is decoded by both: the skim needs its extent).
//! [`decode`] does both into a [`Message`]: it accepts exactly what postcard's
//! decoding of the message accepts and yields the same message (a
//! differential test holds it to that); only the errors say more.

use super::{io_bpf, io_wire, rq, rq_bpf, GuestRecord, GuestRecordRef, Message, ProtoError};
use crate::record::{GuestIo, GuestRq};
use crate::varint;

/// Bytes of records made room for before any is read (a batch announces its
/// count before its records arrive: as serde's cautious size hint).
const PREALLOC_BYTES: usize = 1 << 20;

/// A batch whose structure was checked and whose records are still in their
/// wire form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawBatch {
    /// Sequence number of the first record.
    pub first_seq: u64,
    count: usize,
    /// The records, one after the other, each with its tag.
    bytes: Vec<u8>,
}

/// The kind of a record on the wire (its tag).
#[derive(Clone, Copy)]
enum Kind {
    Rq,
    /// A syscall record's postcard form (tag 4), or its older form (tag 1).
    Io,
    IoV1,
    /// A request record in the BPF layout ([`rq_bpf`]).
    RqBpf,
    /// A syscall record in the BPF layout ([`io_bpf`]).
    IoBpf,
}

/// Takes one record off the front of `b`: its kind and its bytes (a request
/// record's body; a syscall record's whole postcard form, checked).
fn next_record<'a>(b: &mut &'a [u8], index: usize) -> Result<(Kind, &'a [u8]), ProtoError> {
    match varint::take_u32(b).ok_or_else(|| bad_varint(b))? {
        t @ (0 | 2 | 3) => {
            let len = varint::take(b).ok_or_else(|| bad_varint(b))?;
            let len = usize::try_from(len).map_err(|_| end())?;
            let (rec, rest) = b.split_at_checked(len).ok_or_else(end)?;
            *b = rest;
            let kind = match t {
                0 => Kind::Rq,
                2 => Kind::RqBpf,
                _ => Kind::IoBpf,
            };
            Ok((kind, rec))
        }
        1 => Ok((Kind::IoV1, take_postcard::<io_wire::IoV1>(b)?)),
        4 => Ok((Kind::Io, take_postcard::<GuestIo>(b)?)),
        t => Err(ProtoError::BadRecord {
            index,
            source: rq::RqWireError::Tag(t),
        }),
    }
}

/// Takes a `T` in postcard off the front of `b`: its bytes (decoded once, for
/// its extent).
fn take_postcard<'a, T: serde::de::DeserializeOwned>(
    b: &mut &'a [u8],
) -> Result<&'a [u8], ProtoError> {
    let (_, rest) = postcard::take_from_bytes::<T>(b).map_err(ProtoError::Malformed)?;
    let rec = &b[..b.len() - rest.len()];
    *b = rest;
    Ok(rec)
}

impl RawBatch {
    /// Checks a batch message's body (`b`: the payload after its tag): the
    /// sequence number, the count, then exactly that many records, each with
    /// a known tag and all its bytes, and nothing after them. A request
    /// record's contents are checked when it is read ([`BatchReader`]).
    pub(super) fn skim(mut b: &[u8]) -> Result<RawBatch, ProtoError> {
        let first_seq = varint::take(&mut b).ok_or_else(|| bad_varint(b))?;
        let count = varint::take(&mut b).ok_or_else(|| bad_varint(b))?;
        let records = b;
        let mut n = 0usize;
        // Every record takes at least one byte: a count beyond the payload
        // ends at its end, with an error.
        while (n as u64) < count {
            next_record(&mut b, n)?;
            n += 1;
        }
        if !b.is_empty() {
            return Err(ProtoError::TrailingBytes(b.len()));
        }
        Ok(RawBatch {
            first_seq,
            count: n,
            bytes: records.to_vec(),
        })
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Drops the first `n` records (already delivered before a resend).
    pub fn skip(&mut self, n: usize) {
        let mut b = &self.bytes[..];
        let mut k = 0;
        while k < n.min(self.count) && next_record(&mut b, k).is_ok() {
            k += 1;
        }
        let at = self.bytes.len() - b.len();
        self.bytes.drain(..at);
        self.count -= k;
        self.first_seq += k as u64;
    }

    /// Decodes every record (the first bad one is the error).
    pub fn to_records(&self) -> Result<Vec<GuestRecord>, ProtoError> {
        let most = PREALLOC_BYTES / std::mem::size_of::<GuestRecord>();
        let mut records = Vec::with_capacity(self.count.min(most));
        let mut err = None;
        BatchReader::new().read(self, |r| match r {
            Ok(GuestRecordRef::Rq(rq)) => records.push(GuestRecord::Rq(rq.clone())),
            Ok(GuestRecordRef::Io(io)) => records.push(GuestRecord::Io(io.clone())),
            Err(e) => {
                err.get_or_insert(e);
            }
        });
        match err {
            Some(e) => Err(e),
            None => Ok(records),
        }
    }
}

/// Reads a [`RawBatch`]'s records into one request record and one syscall
/// record that it keeps and overwrites: a batch's records are handed out by
/// reference, none is allocated or moved (names are replaced only when they
/// change).
pub struct BatchReader {
    rq: GuestRq,
    io: Option<GuestIo>,
}

impl Default for BatchReader {
    fn default() -> Self {
        Self::new()
    }
}

impl BatchReader {
    pub fn new() -> Self {
        BatchReader {
            rq: rq::blank(),
            io: None,
        }
    }

    /// Calls `each` with every record of `batch` in order, or with why it
    /// does not decode (a bad record is skipped; the others are still read).
    pub fn read(
        &mut self,
        batch: &RawBatch,
        mut each: impl FnMut(Result<GuestRecordRef<'_>, ProtoError>),
    ) {
        let mut b = &batch.bytes[..];
        for index in 0..batch.count {
            match next_record(&mut b, index) {
                Ok((Kind::Rq, rec)) => match rq::decode_into(rec, &mut self.rq) {
                    Ok(()) => each(Ok(GuestRecordRef::Rq(&self.rq))),
                    Err(source) => each(Err(ProtoError::BadRecord { index, source })),
                },
                Ok((Kind::RqBpf, rec)) => match rq_bpf::decode_into(rec, &mut self.rq) {
                    Ok(()) => each(Ok(GuestRecordRef::Rq(&self.rq))),
                    Err(source) => each(Err(ProtoError::BadRecord { index, source })),
                },
                Ok((kind @ (Kind::Io | Kind::IoV1), rec)) => {
                    let io = match kind {
                        Kind::IoV1 => postcard::from_bytes::<io_wire::IoV1>(rec).map(Into::into),
                        _ => postcard::from_bytes::<GuestIo>(rec),
                    };
                    match io {
                        Ok(io) => each(Ok(GuestRecordRef::Io(self.io.insert(io)))),
                        Err(e) => each(Err(ProtoError::Malformed(e))),
                    }
                }
                Ok((Kind::IoBpf, rec)) => {
                    let io = self.io.get_or_insert_with(GuestIo::default);
                    match io_bpf::decode_into(rec, io) {
                        Ok(()) => each(Ok(GuestRecordRef::Io(io))),
                        Err(source) => each(Err(ProtoError::BadRecord { index, source })),
                    }
                }
                // (Not after a skim: it checked every record's extent.)
                Err(e) => return each(Err(e)),
            }
        }
    }
}

/// Decodes a batch message's body: `b` is the payload after its tag.
pub(super) fn decode(b: &[u8]) -> Result<Message, ProtoError> {
    let raw = RawBatch::skim(b)?;
    Ok(Message::Batch {
        first_seq: raw.first_seq,
        records: raw.to_records()?,
    })
}

/// A varint that did not end: cut off by the payload's end, or too long.
fn bad_varint(rest: &[u8]) -> ProtoError {
    if rest.len() < varint::MAX_LEN && rest.iter().all(|&x| x & 0x80 != 0) {
        end()
    } else {
        ProtoError::Malformed(postcard::Error::DeserializeBadVarint)
    }
}

fn end() -> ProtoError {
    ProtoError::Malformed(postcard::Error::DeserializeUnexpectedEnd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{decode_payload, encode_frame, sample_rq};
    use proptest::prelude::*;

    /// postcard's decoding of the whole message, the reference.
    fn reference(payload: &[u8]) -> Result<Message, ()> {
        match postcard::take_from_bytes::<Message>(payload) {
            Ok((m, [])) => Ok(m),
            _ => Err(()),
        }
    }

    /// A batch's payload; its sequence number takes one byte.
    fn batch_payload(n: u64, io: bool) -> Vec<u8> {
        let mut records: Vec<GuestRecord> = (0..n).map(|i| GuestRecord::Rq(sample_rq(i))).collect();
        if io {
            records.insert(0, GuestRecord::Io(crate::proto::tests::io()));
        }
        let f = encode_frame(&Message::Batch {
            first_seq: 100 + n,
            records,
        })
        .unwrap();
        f[crate::proto::FRAME_HEADER..].to_vec()
    }

    #[test]
    fn errors_name_the_record() {
        let mut p = batch_payload(3, false);
        // The last record's points (last bytes of the payload): an unknown
        // point id in the mask.
        let n = p.len();
        p[n - 1] = 0xff;
        p[n - 2] = 0xff;
        let got = decode_payload(&p);
        assert!(reference(&p).is_err());
        assert!(
            matches!(got, Err(ProtoError::BadRecord { index: 2, .. })),
            "{got:?}"
        );
        let mut p = batch_payload(1, false);
        p.push(0);
        assert!(matches!(
            decode_payload(&p),
            Err(ProtoError::TrailingBytes(1))
        ));
        p.truncate(p.len() - 2);
        assert!(matches!(decode_payload(&p), Err(ProtoError::Malformed(_))));
        // A count beyond what the payload holds is a truncation, not a
        // large allocation.
        let mut p = vec![2u8];
        varint::push(&mut p, 1);
        varint::push(&mut p, u64::MAX);
        assert!(matches!(decode_payload(&p), Err(ProtoError::Malformed(_))));
    }

    fn raw(payload: &[u8]) -> RawBatch {
        RawBatch::skim(&payload[1..]).unwrap()
    }

    /// A request record whose contents do not decode passes the skim (its
    /// extent is right) and is the only record the reader refuses.
    #[test]
    fn a_bad_record_is_refused_alone() {
        let mut p = batch_payload(3, true);
        let want = match reference(&p) {
            Ok(Message::Batch { records, .. }) => records,
            _ => unreachable!(),
        };
        // After the tag, the sequence number and the count: the syscall
        // record, then the first request record (tag, length, flags …).
        let mut b = &p[3..];
        let (_, io) = next_record(&mut b, 0).unwrap();
        let flags = 3 + 1 + io.len() + 2;
        p[flags] = 0xff;
        assert!(reference(&p).is_err());
        let batch = raw(&p);
        assert_eq!((batch.first_seq, batch.len()), (103, 4));
        assert_refused_alone(&batch, &want, 1, rq::RqWireError::Flags(0xff));
    }

    /// Reads `batch`: record `bad` is refused for `why`, the others are `want`'s.
    fn assert_refused_alone(
        batch: &RawBatch,
        want: &[GuestRecord],
        bad: usize,
        why: rq::RqWireError,
    ) {
        let mut got = Vec::new();
        BatchReader::new().read(batch, |r| {
            got.push(r.map(|r| match r {
                GuestRecordRef::Rq(x) => GuestRecord::Rq(x.clone()),
                GuestRecordRef::Io(x) => GuestRecord::Io(x.clone()),
            }))
        });
        assert_eq!(got.len(), want.len());
        assert!(
            matches!(&got[bad], Err(ProtoError::BadRecord { index, source })
                if *index == bad && *source == why),
            "{:?}",
            got[bad]
        );
        for i in (0..want.len()).filter(|&i| i != bad) {
            assert_eq!(got[i].as_ref().ok(), Some(&want[i]), "record {i}");
        }
    }

    /// A batch mixing both request-record forms (as a guest agent of protocol
    /// 8 sends the BPF layout): each read as itself; a BPF-layout record that
    /// does not decode (a `kind` that is not a request's) is refused alone,
    /// after a skim that accepted its extent, and postcard's decoding of the
    /// message refuses it too.
    #[test]
    fn both_request_forms_read_and_a_bad_bpf_record_is_refused_alone() {
        let rq = |i| {
            let mut r = sample_rq(i);
            r.time = Some(crate::walltime::WallTime(7_000 + i as i64));
            r
        };
        let mut entries = Vec::new();
        crate::proto::encode_record_append(&GuestRecordRef::Rq(&rq(1)), &mut entries).unwrap();
        rq_bpf::entry_of(&rq(2), &mut entries);
        let bad_at = entries.len() + 3; // (tag, a two-byte length)
        rq_bpf::entry_of(&rq(3), &mut entries);
        rq_bpf::entry_of(&rq(4), &mut entries);
        let mut frame = Vec::new();
        crate::proto::batch_frame(9, 4, [&entries[..]], &mut frame);
        let p = frame[crate::proto::FRAME_HEADER..].to_vec();
        let want: Vec<GuestRecord> = (1..5).map(|i| GuestRecord::Rq(rq(i))).collect();
        assert_eq!(
            reference(&p),
            Ok(Message::Batch {
                first_seq: 9,
                records: want.clone()
            })
        );
        assert_eq!(raw(&p).to_records().unwrap(), want);
        let mut p = p;
        // (offset in the payload: the batch tag, the sequence number, the count)
        p[3 + bad_at] = 2;
        assert!(reference(&p).is_err());
        assert_refused_alone(&raw(&p), &want, 2, rq::RqWireError::Tag(2));
    }

    /// Skipping records already delivered keeps the rest, numbered on.
    #[test]
    fn skip_drops_the_first_records() {
        let p = batch_payload(4, true);
        let all = raw(&p).to_records().unwrap();
        for n in 0..7 {
            let mut b = raw(&p);
            b.skip(n);
            let k = n.min(5);
            assert_eq!((b.first_seq, b.len()), (104 + k as u64, 5 - k));
            assert_eq!(b.to_records().unwrap(), all[k..]);
        }
    }

    proptest! {
        /// Valid batches (with a syscall record or not) and every one of
        /// them with one byte changed or cut: accepted and decoded exactly
        /// when postcard's decoding accepts them, to the same message.
        #[test]
        fn agrees_with_postcard(n in 0u64..6, io in any::<bool>(), at in any::<prop::sample::Index>(), to in any::<u8>(), how in 0u8..4) {
            let mut p = batch_payload(n, io);
            let i = 1 + at.index(p.len() - 1);
            match how {
                0 => p.truncate(i),
                1 => p[i] = to,
                // One byte more after the records or inside them.
                2 => p.insert(i, to),
                // The count (after the one-byte sequence number) too low or high.
                _ => p[2] = (to % 8).min(0x7f),
            }
            let ours = decode(&p[1..]);
            let want = reference(&p);
            prop_assert_eq!(ours.as_ref().ok(), want.as_ref().ok(), "{:?}", ours.as_ref().err());
        }
    }
}
