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

#[cfg(test)]
mod tests {
    use super::*;

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
        let over = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert_eq!(take(&mut &over[..]), None, "65 bits");
    }
}
