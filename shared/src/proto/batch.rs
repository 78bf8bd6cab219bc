//! [`Message::Batch`]'s decoder, by hand: each record goes straight into the
//! batch's vector. (Through postcard's sequence visitor every 400-byte record
//! was moved three times on its way there, which was a tenth of the joined
//! host agent's per-I/O work.) It accepts exactly what postcard's decoding of
//! the message accepts and yields the same message (a differential test holds
//! it to that); only the errors say more.

use super::{rq, GuestRecord, Message, ProtoError};
use crate::record::GuestIo;
use crate::varint;

/// Bytes of records made room for before any is read (a batch announces its
/// count before its records arrive: as serde's cautious size hint).
const PREALLOC_BYTES: usize = 1 << 20;

/// Decodes a batch message's body: `b` is the payload after its tag.
pub(super) fn decode(mut b: &[u8]) -> Result<Message, ProtoError> {
    let first_seq = varint::take(&mut b).ok_or_else(|| bad_varint(b))?;
    let count = varint::take(&mut b).ok_or_else(|| bad_varint(b))?;
    let most = PREALLOC_BYTES / std::mem::size_of::<GuestRecord>();
    let mut records = Vec::with_capacity((count as usize).min(most));
    let mut names = rq::LastNames::default();
    for index in 0..count {
        let bad = |source| ProtoError::BadRecord {
            index: index as usize,
            source,
        };
        match varint::take_u32(&mut b).ok_or_else(|| bad_varint(b))? {
            0 => {
                let len = varint::take(&mut b).ok_or_else(|| bad_varint(b))?;
                let len = usize::try_from(len).map_err(|_| end())?;
                let (rec, rest) = b.split_at_checked(len).ok_or_else(end)?;
                b = rest;
                records.push(GuestRecord::Rq(
                    rq::decode_after(rec, &mut names).map_err(bad)?,
                ));
            }
            1 => {
                let (io, rest) =
                    postcard::take_from_bytes::<GuestIo>(b).map_err(ProtoError::Malformed)?;
                b = rest;
                records.push(GuestRecord::Io(io));
            }
            t => return Err(bad(rq::RqWireError::Tag(t))),
        }
    }
    if !b.is_empty() {
        return Err(ProtoError::TrailingBytes(b.len()));
    }
    Ok(Message::Batch { first_seq, records })
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
