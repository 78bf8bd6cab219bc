//! Wall-clock time of records: `CLOCK_MONOTONIC` timestamps (what BPF's
//! `bpf_ktime_get_ns` and every record's points use) mapped onto
//! `CLOCK_REALTIME`, written as RFC 3339 UTC in JSON.
//!
//! The mapping is the offset `realtime − monotonic`, measured by reading the
//! realtime clock between two monotonic reads and keeping the tightest of a few
//! tries: the offset is then known within half that gap ([`uncertainty_ns`],
//! typically well under a microsecond). Both clocks are slewed alike by NTP;
//! only a step of the realtime clock (settimeofday, an NTP step) changes the
//! offset, so it is measured again at most once a second of the timestamps
//! being mapped ([`at`] does it lazily: no agent loop needs to call anything).
//! A record's `time` is the wall-clock time of its first point.

use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use chrono::{DateTime, SecondsFormat, Utc};
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::clock::monotonic_ns;

/// How often (in mapped monotonic ns) the offset is measured again.
const REFRESH_NS: u64 = 1_000_000_000;
/// Tries per measurement; the one with the smallest monotonic gap wins.
const TRIES: usize = 5;

/// A wall-clock instant: ns since the Unix epoch (UTC). JSON: an RFC 3339 UTC
/// string with nanoseconds (`2026-11-23T11:32:42.123456789Z`); binary formats
/// (the wire protocol): the i64.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WallTime(pub i64);

impl WallTime {
    pub fn unix_ns(self) -> i64 {
        self.0
    }

    /// RFC 3339 UTC with nanoseconds.
    pub fn rfc3339(self) -> String {
        DateTime::<Utc>::from_timestamp_nanos(self.0).to_rfc3339_opts(SecondsFormat::Nanos, true)
    }

    /// Parses an RFC 3339 time (any offset; converted to UTC).
    pub fn parse(s: &str) -> Result<WallTime, String> {
        let t = DateTime::parse_from_rfc3339(s).map_err(|e| format!("bad time {s:?}: {e}"))?;
        t.timestamp_nanos_opt()
            .map(WallTime)
            .ok_or_else(|| format!("time {s:?} out of range"))
    }
}

impl fmt::Display for WallTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.rfc3339())
    }
}

impl Serialize for WallTime {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&self.rfc3339())
        } else {
            s.serialize_i64(self.0)
        }
    }
}

impl<'de> Deserialize<'de> for WallTime {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = WallTime;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an RFC 3339 time or ns since the Unix epoch")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<WallTime, E> {
                WallTime::parse(v).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WallTime, E> {
                Ok(WallTime(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WallTime, E> {
                i64::try_from(v)
                    .map(WallTime)
                    .map_err(|_| E::custom("time out of range"))
            }
        }
        if d.is_human_readable() {
            d.deserialize_any(V)
        } else {
            d.deserialize_i64(V)
        }
    }
}

/// Reads `CLOCK_REALTIME` in ns since the epoch.
pub fn realtime_ns() -> i64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME) {
        Ok(ts) => ts
            .tv_sec()
            .saturating_mul(1_000_000_000)
            .saturating_add(ts.tv_nsec()),
        Err(_) => 0,
    }
}

/// One measurement of `realtime − monotonic`: (offset ns, uncertainty ns).
pub fn measure_offset() -> (i64, u64) {
    let mut best = (0i64, u64::MAX);
    for _ in 0..TRIES {
        let a = monotonic_ns();
        let r = realtime_ns();
        let b = monotonic_ns();
        let gap = b.saturating_sub(a);
        if gap < best.1 {
            let mid = a + gap / 2;
            best = (r.saturating_sub(mid as i64), gap.div_ceil(2));
        }
    }
    best
}

static OFFSET: AtomicI64 = AtomicI64::new(0);
static UNCERTAINTY: AtomicU64 = AtomicU64::new(u64::MAX);
/// Monotonic time of the last measurement (0: never).
static MEASURED_AT: AtomicU64 = AtomicU64::new(0);

/// Measures the offset now (also done lazily by [`at`]).
pub fn refresh() {
    let (off, unc) = measure_offset();
    OFFSET.store(off, Ordering::Relaxed);
    UNCERTAINTY.store(unc, Ordering::Relaxed);
    MEASURED_AT.store(monotonic_ns().max(1), Ordering::Relaxed);
}

/// The wall-clock time of a `CLOCK_MONOTONIC` timestamp of this machine.
pub fn at(mono_ns: u64) -> WallTime {
    WallTime((mono_ns as i64).saturating_add(offset_near(mono_ns)))
}

/// `CLOCK_REALTIME − CLOCK_MONOTONIC` (ns) for a monotonic time `mono_ns`:
/// the offset [`at`] adds (measured again when `mono_ns` is more than a
/// second after its last measurement).
pub fn offset_near(mono_ns: u64) -> i64 {
    let m = MEASURED_AT.load(Ordering::Relaxed);
    if m == 0 || mono_ns > m.saturating_add(REFRESH_NS) {
        refresh();
    }
    OFFSET.load(Ordering::Relaxed)
}

/// Uncertainty (±ns) of the current mapping (`u64::MAX` before the first one).
pub fn uncertainty_ns() -> u64 {
    UNCERTAINTY.load(Ordering::Relaxed)
}

/// The wall-clock time of a record's first point, if it has one.
pub fn of_points(ts: &crate::record::Points) -> Option<WallTime> {
    ts.iter().map(|(_, t)| t).min().map(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_roundtrip_in_json_and_postcard() {
        let t = WallTime(1_795_433_562_123_456_789);
        assert_eq!(t.rfc3339(), "2026-11-23T11:32:42.123456789Z");
        let j = serde_json::to_string(&t).unwrap();
        assert_eq!(j, "\"2026-11-23T11:32:42.123456789Z\"");
        assert_eq!(serde_json::from_str::<WallTime>(&j).unwrap(), t);
        let b = postcard::to_stdvec(&t).unwrap();
        assert_eq!(postcard::from_bytes::<WallTime>(&b).unwrap(), t);
        // Other offsets are converted to UTC; garbage is an error.
        assert_eq!(
            WallTime::parse("2026-11-23T12:32:42.123456789+01:00").unwrap(),
            t
        );
        assert!(serde_json::from_str::<WallTime>("\"yesterday\"").is_err());
    }

    #[test]
    fn mapping_agrees_with_the_realtime_clock() {
        refresh();
        let unc = uncertainty_ns();
        assert!(unc < 1_000_000, "offset measured within {unc} ns");
        let before = realtime_ns();
        let w = at(monotonic_ns());
        let after = realtime_ns();
        // Within the read window, widened by the mapping's uncertainty (and a
        // scheduling hiccup between the reads cannot make it lie outside).
        assert!(
            w.0 >= before - unc as i64 && w.0 <= after + unc as i64,
            "{before} <= {} <= {after} ± {unc}",
            w.0
        );
    }

    #[test]
    fn first_point_gives_the_time() {
        use crate::record::{Point, Points};
        let now = monotonic_ns();
        let p: Points = [(Point::HostPush, now), (Point::Kick, now - 1_000_000)]
            .into_iter()
            .collect();
        let t = of_points(&p).unwrap();
        assert_eq!(t, at(now - 1_000_000));
        assert_eq!(of_points(&Points::new()), None);
    }
}
