//! Checks shared by the end-to-end tests: joined records against the guest's, host elements
//! against the known workload.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;
use viotrace_vm_tests::RunResult;

use super::{known_io_shape, Shape};

pub fn rec_key(v: &Value) -> (String, String, u64, u64) {
    (
        v["disk"].as_str().unwrap_or("?").to_string(),
        v["op"].as_str().unwrap_or("?").to_string(),
        v["sector"].as_u64().unwrap_or(u64::MAX),
        v["bytes"].as_u64().unwrap_or(0),
    )
}

/// Checks the joined records against the guest's own: coverage, stages, consistency.
pub fn check_joined(guest: &[Value], joined: &[Value], min_ratio: f64) {
    let guest_rqs: Vec<&Value> = guest.iter().filter(|v| v["kind"] == "guest_rq").collect();
    assert!(
        guest_rqs.len() > 500,
        "too few guest requests: {}",
        guest_rqs.len()
    );
    let mut joined_keys: HashMap<(String, String, u64, u64), usize> = HashMap::new();
    let mut n_joined = 0;
    for j in joined {
        assert_eq!(j["kind"], "io", "{j}");
        if j["joined"] != true {
            assert!(j["reason"].is_string(), "unmatched without a reason: {j}");
            continue;
        }
        n_joined += 1;
        *joined_keys.entry(rec_key(j)).or_default() += 1;
        // Both sides are there, in one clock domain.
        assert_eq!(j["ts_domain"], "host", "{j}");
        let ts = j["ts"].as_object().unwrap();
        assert!(ts.keys().any(|k| k.starts_with("g.")) && ts.keys().any(|k| k.starts_with("h.")));
        let unc = j["clock_uncertainty_ns"].as_i64().expect("uncertainty");
        let stages = j["stages"].as_object().expect("stages");
        let mut sum = 0i64;
        for (name, ns) in stages {
            let ns = ns.as_i64().unwrap();
            assert!(ns >= -unc, "stage {name} = {ns} < -{unc}: {j}");
            sum += ns;
        }
        assert_eq!(
            Some(sum),
            j["total_ns"].as_i64(),
            "stages add up to total: {j}"
        );
        for s in [
            "guest_queue",
            "kick_to_pop",
            "host_io",
            "push_to_irq",
            "guest_complete",
        ] {
            // Flushes made by the flush machinery have no bio of their own.
            if s == "guest_queue" && !ts.contains_key("g.bio_queue") {
                continue;
            }
            assert!(
                stages
                    .keys()
                    .any(|k| k == s || k.split('+').any(|p| p == s)),
                "stage {s} missing: {j}"
            );
        }
    }
    // Every guest request (op, sector, bytes on its disk) has its joined record.
    let mut missing = 0usize;
    for g in &guest_rqs {
        match joined_keys.get_mut(&rec_key(g)) {
            Some(n) if *n > 0 => *n -= 1,
            _ => missing += 1,
        }
    }
    let ratio = 1.0 - missing as f64 / guest_rqs.len() as f64;
    assert!(
        ratio >= min_ratio,
        "only {:.4} of {} guest requests joined ({missing} missing, {n_joined} joined records)",
        ratio,
        guest_rqs.len()
    );
}

/// Host records of the workload window (the host also sees the guest's boot-time I/O,
/// such as the partition scan of each disk).
pub fn elems(r: &RunResult) -> Vec<Value> {
    assert!(r.workload_start_ns > 0 && r.workload_end_ns >= r.workload_start_ns);
    r.jsonl("host.jsonl")
        .expect("host.jsonl")
        .into_iter()
        .filter(|v| v["kind"] == "host_elem")
        .filter(|v| {
            let first = v["ts"]
                .as_object()
                .and_then(|m| m.values().filter_map(|t| t.as_u64()).min())
                .unwrap_or(0);
            first >= r.workload_start_ns
        })
        .collect()
}

pub fn shape(recs: &[&Value]) -> Shape {
    let mut m = BTreeMap::new();
    for v in recs {
        *m.entry((
            v["op"].as_str().unwrap_or("?").to_string(),
            v["bytes"].as_u64().unwrap_or(0),
        ))
        .or_default() += 1;
    }
    m
}

/// The vdb device's records: the device whose records carry the known workload.
pub fn known_io_device(all: &[Value]) -> Vec<&Value> {
    let mut by_dev: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for v in all {
        by_dev
            .entry(v["device"].as_str().unwrap_or("?").to_string())
            .or_default()
            .push(v);
    }
    let expect = known_io_shape();
    let shapes: Vec<(String, Shape)> = by_dev.iter().map(|(d, v)| (d.clone(), shape(v))).collect();
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
    let host = r.jsonl("host.jsonl").expect("host.jsonl");
    let last = host
        .iter()
        .rev()
        .find(|v| v["kind"] == "stats")
        .expect("host stats line");
    let acct = last["transport"]
        .as_array()
        .and_then(|a| a.iter().find(|a| a["vm"] == vm))
        .unwrap_or_else(|| panic!("no transport account for {vm}: {last}"));
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
