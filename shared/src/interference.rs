//! Interference measured while one request was in flight: what else was using
//! the host's CPUs and the request's host device (the evidence of the why-slow
//! verdicts, see `cause`).
//!
//! The host agent fills it: the device load from its BPF record (other
//! issuers' block requests on the same host device), the run-queue waits of the
//! VM's QEMU threads from its wait records, overlapped with the request's own
//! time window ([`overlap_ns`]).

use serde::{Deserialize, Serialize};

/// Evidence of interference with one request (JSON: the record's `interference`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interference {
    /// The request's host device and its other issuers (JSON: these fields
    /// inline).
    #[serde(flatten)]
    pub device: DeviceLoad,
    /// The heaviest other issuers on that device over the last second, with
    /// their share of its other requests: `pid 4242 fio 91 %`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub neighbours: Vec<String>,
    /// Time QEMU's threads other than its vCPUs (main loop, I/O threads,
    /// thread-pool workers) spent runnable but not running while the request was
    /// in flight (its first to its last point), ns (overlaps merged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu_wait_ns: Option<u64>,
    /// Time this VM's vCPU threads waited for a CPU between the guest's kick and
    /// QEMU taking the request, and between QEMU's notification and the guest's
    /// interrupt, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpu_wait_ns: Option<u64>,
    /// The task that held the CPU longest while those threads waited: `pid 77 stress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_holder: Option<String>,
    /// Other requests of the same VM on the same virtqueue whose lifetimes
    /// overlapped this one's (those that finished before it was judged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_overlap: Option<u32>,
}

/// The load on a request's host device: what a host element carries from its
/// BPF record (the part of [`Interference`] known when the element is made,
/// kept small because every pending element holds one; the rest is filled
/// on the joined record).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceLoad {
    /// The host block device of the backend I/O: `vda (254:0)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_disk: Option<crate::record::Name>,
    /// Block requests of other issuers (host processes, other VMs) in flight on
    /// that device when this request's first block request was issued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub neighbour_inflight: Option<u32>,
    /// Block requests of other issuers issued on that device while this
    /// request's were on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub neighbour_issued: Option<u32>,
    /// Their bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub neighbour_bytes: Option<u64>,
}

impl Interference {
    /// Other issuers' requests seen around this one (in flight at issue + issued meanwhile).
    pub fn neighbour_load(&self) -> u32 {
        let d = &self.device;
        d.neighbour_inflight
            .unwrap_or(0)
            .saturating_add(d.neighbour_issued.unwrap_or(0))
    }
}

/// Total length of the parts of `[from, to)` covered by `intervals` (which may
/// overlap each other), ns.
pub fn overlap_ns(intervals: &[(u64, u64)], from: u64, to: u64) -> u64 {
    let mut cut: Vec<(u64, u64)> = intervals
        .iter()
        .map(|&(a, b)| (a.max(from), b.min(to)))
        .filter(|(a, b)| a < b)
        .collect();
    cut.sort_unstable();
    let mut total = 0;
    let mut cur: Option<(u64, u64)> = None;
    for (a, b) in cut {
        match cur {
            Some((ca, cb)) if a <= cb => cur = Some((ca, cb.max(b))),
            Some((ca, cb)) => {
                total += cb - ca;
                cur = Some((a, b));
            }
            None => cur = Some((a, b)),
        }
    }
    total + cur.map_or(0, |(a, b)| b - a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_merges_and_clips() {
        assert_eq!(overlap_ns(&[], 0, 100), 0);
        assert_eq!(overlap_ns(&[(10, 20)], 0, 100), 10);
        assert_eq!(overlap_ns(&[(10, 20), (15, 30)], 0, 100), 20);
        assert_eq!(overlap_ns(&[(10, 20), (40, 50)], 15, 45), 10);
        assert_eq!(overlap_ns(&[(0, 1000)], 100, 200), 100);
        assert_eq!(overlap_ns(&[(300, 400)], 100, 200), 0);
    }

    #[test]
    fn neighbour_load_adds_and_saturates() {
        let i = Interference {
            device: DeviceLoad {
                neighbour_inflight: Some(3),
                neighbour_issued: Some(u32::MAX),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(i.neighbour_load(), u32::MAX);
        assert_eq!(Interference::default().neighbour_load(), 0);
    }

    /// The device load's fields stand inline in the record's `interference`
    /// (as before it had a type of its own), and read back the same.
    #[test]
    fn device_load_is_inline_in_json() {
        let i = Interference {
            device: DeviceLoad {
                host_disk: Some("vda (254:0)".into()),
                neighbour_inflight: Some(2),
                neighbour_issued: None,
                neighbour_bytes: Some(4096),
            },
            qemu_wait_ns: Some(7),
            ..Default::default()
        };
        let j = serde_json::to_string(&i).unwrap();
        assert_eq!(
            j,
            r#"{"host_disk":"vda (254:0)","neighbour_inflight":2,"neighbour_bytes":4096,"qemu_wait_ns":7}"#
        );
        assert_eq!(serde_json::from_str::<Interference>(&j).unwrap(), i);
        assert_eq!(
            serde_json::from_str::<DeviceLoad>(&j).unwrap(),
            i.device,
            "a host element reads the device part of a joined record's evidence"
        );
    }
}
