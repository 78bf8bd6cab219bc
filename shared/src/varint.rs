//! LEB128 unsigned varints, as postcard writes them: the frame layer's peeks
//! and hand-made batch headers, and the points' byte string.

/// Most bytes a u64 takes.
pub(crate) const MAX_LEN: usize = 10;

/// Writes `v` at `buf[at..]`; returns the index after it. `buf` must have
/// room for [`MAX_LEN`] bytes from `at` (else it panics).
#[inline(always)]
pub(crate) fn put(buf: &mut [u8], mut at: usize, mut v: u64) -> usize {
    while v >= 0x80 {
        buf[at] = (v as u8) | 0x80;
        v >>= 7;
        at += 1;
    }
    buf[at] = v as u8;
    at + 1
}

/// Appends `v` to `out`.
#[inline]
pub(crate) fn push(out: &mut Vec<u8>, mut v: u64) {
    // Byte by byte: a copy from a scratch array is a `memcpy` call per number.
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A signed number as an unsigned one that stays short when small either way
/// (zigzag: 0, -1, 1, -2 … become 0, 1, 2, 3 …).
#[inline]
pub(crate) fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

/// The inverse of [`zigzag`].
#[inline]
pub(crate) fn unzigzag(z: u64) -> i64 {
    (z >> 1) as i64 ^ -((z & 1) as i64)
}

/// Reads a varint at the front of `b` and moves `b` past it; None when it is
/// truncated or longer than 64 bits.
#[inline(always)]
pub(crate) fn take(b: &mut &[u8]) -> Option<u64> {
    // Most numbers of a record (point differences, ids, lengths) take one
    // to three bytes.
    match **b {
        [x, ref rest @ ..] if x < 0x80 => {
            *b = rest;
            return Some(u64::from(x));
        }
        [x, y, ref rest @ ..] if y < 0x80 => {
            *b = rest;
            return Some(u64::from(x & 0x7f) | u64::from(y) << 7);
        }
        [x, y, z, ref rest @ ..] if z < 0x80 => {
            *b = rest;
            return Some(u64::from(x & 0x7f) | u64::from(y & 0x7f) << 7 | u64::from(z) << 14);
        }
        _ => {}
    }
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(MAX_LEN) {
        let bits = u64::from(byte & 0x7f);
        if i == MAX_LEN - 1 && bits > 1 {
            return None; // beyond 64 bits
        }
        v |= bits << (7 * i);
        if byte & 0x80 == 0 {
            *b = &b[i + 1..];
            return Some(v);
        }
    }
    None
}

/// A `u32` varint as postcard reads one (an enum's tag): at most five bytes,
/// the value within 32 bits; `b` is left as it was when there is none.
#[inline]
pub(crate) fn take_u32(b: &mut &[u8]) -> Option<u32> {
    let mut rest = *b;
    let v = u32::try_from(take(&mut rest)?).ok()?;
    if b.len() - rest.len() > 5 {
        return None;
    }
    *b = rest;
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_a_u32_as_postcard_reads_it() {
        for v in [0u32, 1, 127, 128, u32::MAX] {
            let bytes = postcard::to_stdvec(&v).unwrap();
            let mut b = &bytes[..];
            assert_eq!(take_u32(&mut b), Some(v));
            assert!(b.is_empty());
        }
        // Five bytes for 0 are a u32; six are not (a u64 reader takes them).
        let five = [0x80, 0x80, 0x80, 0x80, 0x00];
        assert_eq!(postcard::from_bytes::<u32>(&five).ok(), Some(0));
        assert_eq!(take_u32(&mut &five[..]), Some(0));
        let six = [0x80, 0x80, 0x80, 0x80, 0x80, 0x00];
        assert!(postcard::from_bytes::<u32>(&six).is_err());
        assert_eq!(take_u32(&mut &six[..]), None);
        // 2^32 does not fit, nor does a fifth byte with a continuation bit.
        let over = [0xff, 0xff, 0xff, 0xff, 0x10];
        assert!(postcard::from_bytes::<u32>(&over).is_err());
        assert_eq!(take_u32(&mut &over[..]), None);
        assert_eq!(
            take_u32(&mut &[0xff, 0xff, 0xff, 0xff, 0x8f, 0x00][..]),
            None
        );
        let mut cut = &[0x80][..];
        assert_eq!(take_u32(&mut cut), None);
        assert_eq!(cut, [0x80], "left as it was");
    }

    #[test]
    fn agrees_with_postcard_and_refuses_what_is_not_a_u64() {
        for v in [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX] {
            let mut ours = Vec::new();
            push(&mut ours, v);
            assert_eq!(ours, postcard::to_stdvec(&v).unwrap(), "{v}");
            let mut b = &ours[..];
            assert_eq!(take(&mut b), Some(v));
            assert!(b.is_empty());
        }
        assert_eq!(take(&mut &[0x80][..]), None, "truncated");
        assert_eq!(take(&mut &[0x80, 0x80][..]), None, "truncated");
        assert_eq!(take(&mut &[0x81, 0x80, 0x80][..]), None, "truncated");
        let over = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert_eq!(take(&mut &over[..]), None, "65 bits");
    }

    proptest::proptest! {
        /// Every value and every shorter prefix of its bytes, followed by
        /// anything: the value and the rest, or None for a prefix.
        #[test]
        fn takes_what_push_writes(v in proptest::num::u64::ANY, shift in 0u32..64, tail in proptest::collection::vec(0u8.., 0..4)) {
            let v = v >> shift;
            let mut bytes = Vec::new();
            push(&mut bytes, v);
            let n = bytes.len();
            bytes.extend_from_slice(&tail);
            let mut b = &bytes[..];
            proptest::prop_assert_eq!(take(&mut b), Some(v));
            proptest::prop_assert_eq!(b, &tail[..]);
            for k in 0..n {
                proptest::prop_assert_eq!(take(&mut &bytes[..k]), None);
            }
        }
    }
}
