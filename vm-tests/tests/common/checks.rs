//! Checks shared by the end-to-end tests: joined records against the guest's, host elements
//! against the known workload.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

use viotrace_shared::record::{ClockDomain, GuestRq, HostElem, JoinedIo, Op, Point};
use viotrace_vm_tests::records::Records;
use viotrace_vm_tests::RunResult;

use super::{known_io_shape, Shape};

/// A request's identity across the boundary: (disk, op, sector, bytes).
pub type Key = (String, Op, u64, u32);

pub fn guest_key(g: &GuestRq) -> Key {
    (g.disk.to_string(), g.op, g.sector, g.bytes)
}

pub fn joined_key(j: &JoinedIo) -> Key {
    (
        j.disk.as_deref().unwrap_or("?").to_string(),
        j.op,
        j.sector,
        j.bytes,
    )
}

/// Checks the joined records against the guest's own: coverage, stages, consistency.
pub fn check_joined(guest: &[&GuestRq], joined: &[&JoinedIo], min_ratio: f64) {
    assert!(guest.len() > 500, "too few guest requests: {}", guest.len());
    let mut joined_keys: HashMap<Key, usize> = HashMap::new();
    let mut n_joined = 0;
    for j in joined {
        if !j.joined {
            assert!(j.reason.is_some(), "unmatched without a reason: {j:?}");
            continue;
        }
        n_joined += 1;
        *joined_keys.entry(joined_key(j)).or_default() += 1;
        // Both sides are there, in one clock domain.
        assert_eq!(j.ts_domain, ClockDomain::Host, "{j:?}");
        let names: Vec<&str> = j.ts.iter().map(|(p, _)| p.name()).collect();
        assert!(
            names.iter().any(|k| k.starts_with("g.")) && names.iter().any(|k| k.starts_with("h.")),
            "{j:?}"
        );
        let unc = j.clock_uncertainty_ns.expect("uncertainty") as i64;
        let mut sum = 0i64;
        for (name, ns) in j.stages.iter() {
            assert!(ns >= -unc, "stage {name} = {ns} < -{unc}: {j:?}");
            sum += ns;
        }
        assert_eq!(Some(sum), j.total_ns, "stages add up to total: {j:?}");
        for s in [
            "guest_queue",
            "kick_to_pop",
            "host_io",
            "push_to_irq",
            "guest_complete",
        ] {
            // Flushes made by the flush machinery have no bio of their own.
            if s == "guest_queue" && j.ts.get(Point::BioQueue).is_none() {
                continue;
            }
            assert!(
                j.stages
                    .iter()
                    .any(|(k, _)| k == s || k.split('+').any(|p| p == s)),
                "stage {s} missing: {j:?}"
            );
        }
    }
    // Every guest request (op, sector, bytes on its disk) has its joined record.
    let mut missing = 0usize;
    for g in guest {
        match joined_keys.get_mut(&guest_key(g)) {
            Some(n) if *n > 0 => *n -= 1,
            _ => missing += 1,
        }
    }
    let ratio = 1.0 - missing as f64 / guest.len() as f64;
    assert!(
        ratio >= min_ratio,
        "only {:.4} of {} guest requests joined ({missing} missing, {n_joined} joined records)",
        ratio,
        guest.len()
    );
}

/// [`check_joined`] over a run's `guest.jsonl` and `joined.jsonl`.
pub fn check_run_joined(r: &RunResult, min_ratio: f64) {
    let guest = r.records("guest.jsonl").expect("guest.jsonl");
    let joined = r.records("joined.jsonl").expect("joined.jsonl");
    check_joined(&guest.guest_rqs(), &joined.ios(), min_ratio);
}

/// Host records of the workload window (the host also sees the guest's boot-time I/O,
/// such as the partition scan of each disk).
pub fn elems(r: &RunResult) -> Vec<HostElem> {
    assert!(r.workload_start_ns > 0 && r.workload_end_ns >= r.workload_start_ns);
    let host: Records = r.records("host.jsonl").expect("host.jsonl");
    host.host_elems()
        .into_iter()
        .filter(|e| e.ts.iter().map(|(_, t)| t).min().unwrap_or(0) >= r.workload_start_ns)
        .cloned()
        .collect()
}

/// Requests by (op, bytes).
pub fn shape(recs: impl IntoIterator<Item = (Op, u32)>) -> Shape {
    let mut m = BTreeMap::new();
    for (op, bytes) in recs {
        *m.entry((op.name().to_string(), u64::from(bytes)))
            .or_default() += 1;
    }
    m
}

/// The elements' shape.
pub fn elem_shape(recs: &[&HostElem]) -> Shape {
    shape(recs.iter().map(|e| (e.op, e.bytes)))
}

/// The vdb device's records: the device whose records carry the known workload.
pub fn known_io_device(all: &[HostElem]) -> Vec<&HostElem> {
    let mut by_dev: BTreeMap<String, Vec<&HostElem>> = BTreeMap::new();
    for e in all {
        by_dev.entry(e.device.to_string()).or_default().push(e);
    }
    let expect = known_io_shape();
    let shapes: Vec<(String, Shape)> = by_dev
        .iter()
        .map(|(d, v)| (d.clone(), elem_shape(v)))
        .collect();
    let Some((dev, _)) = shapes.iter().find(|(_, s)| *s == expect) else {
        panic!(
            "no device carries exactly the known I/O; per device (op, bytes) counts: {shapes:?}"
        );
    };
    by_dev.remove(dev).unwrap()
}

/// The transport identity of a joined run, on both sides: every record the guest
/// produced was delivered (none lost, refused or left unacknowledged), and the host
/// agent's per-VM account balances. Returns the number of records delivered.
pub fn check_transport(r: &RunResult, vm: &str) -> u64 {
    let host = r.records("host.jsonl").expect("host.jsonl");
    let last = host.stats().expect("host stats line");
    let acct = last
        .transport
        .as_ref()
        .and_then(|a| a.iter().find(|a| a["vm"] == vm))
        .unwrap_or_else(|| panic!("no transport account for {vm}: {last:?}"));
    assert_eq!(acct["balanced"], true, "{acct}");
    for k in ["lost_in_transit", "in_flight", "guest_dropped_full"] {
        assert_eq!(acct[k], 0, "{k} in {acct}");
    }
    let produced = acct["produced"].as_u64().unwrap();
    let before = acct["before_host"].as_u64().unwrap();
    assert_eq!(
        acct["delivered"].as_u64(),
        Some(produced - before),
        "{acct}"
    );
    let glog = std::fs::read_to_string(r.path("guest.log")).unwrap_or_default();
    let line = glog
        .lines()
        .find(|l| l.contains("viotrace-guest: uplink: offered="))
        .unwrap_or_else(|| panic!("guest agent printed no uplink identity:\n{glog}"));
    assert!(
        line.contains("refused_buffer_full=0 + unacked_at_exit=0 (balanced)"),
        "{line}"
    );
    acct["delivered"].as_u64().unwrap()
}
