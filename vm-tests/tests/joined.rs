//! End-to-end tests of the joined mode (issue 5): both agents, one record per I/O.

use std::collections::BTreeSet;

use serde_json::Value;
use viotrace_vm_tests::records::Records;
use viotrace_vm_tests::{assets, Agents, RunResult, VmConfig};

mod common;
use common::checks::{check_run_joined, check_transport};
use common::run_agents;

/// Random and sequential reads and writes on vdb (raw) and buffered writes + fsync on /data.
const MIXED: &str = "set -e\n\
fio --name=rr --filename=/dev/vdb --rw=randread --bs=4k --direct=1 --ioengine=psync --size=32M \
--number_ios=300 --output=/dev/null\n\
fio --name=rw --filename=/dev/vdb --rw=randwrite --bs=4k --direct=1 --ioengine=libaio --iodepth=8 \
--size=32M --number_ios=300 --output=/dev/null\n\
fio --name=sr --filename=/dev/vdb --rw=read --bs=128k --direct=1 --ioengine=psync --offset=32M \
--size=8M --output=/dev/null\n\
fio --name=sw --filename=/dev/vdb --rw=write --bs=64k --direct=1 --ioengine=libaio --iodepth=4 \
--offset=40M --size=8M --output=/dev/null\n\
dd if=/dev/urandom of=/data/buffered.dat bs=4k count=100 conv=fsync 2>/dev/null\n\
sleep 1\n";

fn run_both(name: &str, cfg: VmConfig, workload: &str) -> RunResult {
    let r = run_agents(name, Agents::Both, cfg, workload);
    let hlog = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert_eq!(r.host_agent_rc, Some(0), "host agent:\n{hlog}");
    assert_eq!(r.guest_agent_rc, Some(0), "guest agent");
    r
}

#[test]
fn mixed_workload_one_queue_is_joined() {
    let trace = assets::workspace_root().join("target/lab-tests/joined-1q-trace.json");
    let _ = std::fs::remove_file(&trace);
    let r = run_both(
        "joined-1q",
        VmConfig {
            host_args: vec!["--chrome-trace".into(), trace.display().to_string()],
            ..VmConfig::default()
        },
        MIXED,
    );
    let joined = r.records("joined.jsonl").unwrap();
    check_run_joined(&r, 0.999);
    check_transport(&r, "vt-joined-1q");

    // The Perfetto / chrome://tracing export: one process for the VM, a track per
    // disk queue, one complete slice per request with its stages nested inside.
    let t: Value = serde_json::from_slice(&std::fs::read(&trace).expect("trace written"))
        .expect("trace is JSON");
    let events = t["traceEvents"].as_array().expect("traceEvents");
    let names: BTreeSet<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        names.contains("vt-joined-1q"),
        "process named after the VM: {names:?}"
    );
    assert!(
        names.iter().any(|n| n.starts_with("vdb q0")),
        "track per queue: {names:?}"
    );
    let slices: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let n_joined = joined.ios().iter().filter(|j| j.joined).count();
    let requests = slices.iter().filter(|e| e["cat"] == "io").count();
    assert!(
        requests >= n_joined,
        "{requests} request slices for {n_joined} joined I/Os"
    );
    assert!(
        slices
            .iter()
            .any(|e| e["cat"] == "stage" && e["name"] == "host_io"),
        "stages as slices"
    );
}

/// The mixed workload, then a short job pinned to each vCPU: blk-mq maps vCPU n to
/// queue n, and the scheduler alone may keep every fio on one vCPU (CI saw only q1).
fn mixed_on_each_cpu() -> String {
    let pinned: String = (0..2)
        .map(|cpu| {
            format!(
                "fio --name=pin{cpu} --filename=/dev/vdb --rw=randread --bs=4k --direct=1 \
                 --ioengine=psync --size=32M --number_ios=100 --cpus_allowed={cpu} \
                 --output=/dev/null\n"
            )
        })
        .collect();
    let mixed = MIXED.strip_suffix("sleep 1\n").unwrap_or(MIXED);
    format!("{mixed}{pinned}sleep 1\n")
}

#[test]
fn mixed_workload_two_queues_is_joined() {
    let r = run_both(
        "joined-2q",
        VmConfig {
            smp: 2,
            queues: 2,
            ..VmConfig::default()
        },
        &mixed_on_each_cpu(),
    );
    check_run_joined(&r, 0.999);
    check_transport(&r, "vt-joined-2q");
    let joined = r.records("joined.jsonl").unwrap();
    let queues: BTreeSet<u16> = joined
        .ios()
        .iter()
        .filter(|j| j.joined && j.disk.as_deref() == Some("vdb"))
        .filter_map(|j| j.queue)
        .collect();
    assert_eq!(queues.into_iter().collect::<Vec<_>>(), vec![0, 1]);
}

/// Always-on (no --json): the joined output gets the records at or above the
/// threshold and one in N; the statistics and the accounting keep every record.
#[test]
fn always_on_writes_the_slow_and_the_sampled_records() {
    let r = run_both(
        "joined-always-on",
        VmConfig {
            host_json: false,
            host_args: vec![
                "-t".into(),
                "3ms".into(),
                "--sample-every".into(),
                "50".into(),
            ],
            ..VmConfig::default()
        },
        MIXED,
    );
    // (without --json the agent's tables and totals go to stdout: host.jsonl)
    let hlog = ["host.log", "host.jsonl"]
        .map(|f| std::fs::read_to_string(r.path(f)).unwrap_or_default())
        .join("\n");
    let line = hlog
        .lines()
        .find(|l| l.contains("vm vt-joined-always-on: guest records"))
        .unwrap_or_else(|| panic!("no accounting line:\n{hlog}"));
    let num = |k: &str| -> u64 {
        let v = line
            .split(&format!(" {k}="))
            .nth(1)
            .unwrap_or_else(|| panic!("{k}: {line}"));
        v.split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (written, summarized, limited) = (
        num("written"),
        num("summarized"),
        num("output_rate_limited"),
    );
    let joined = r.records("joined.jsonl").unwrap();
    let ios = joined.ios();
    let fast = ios
        .iter()
        .filter(|j| !(j.joined && j.total_ns.is_some_and(|t| t >= 3_000_000)))
        .count();
    let offered = written + summarized + limited;
    eprintln!(
        "always-on: {offered} records, {written} written ({fast} below 3 ms), {summarized} summarized"
    );
    assert_eq!(ios.len() as u64, written, "{line}");
    assert!(
        offered > 500,
        "the workload makes over 500 requests: {line}"
    );
    assert!(summarized > 0 && written < offered / 2, "{line}");
    // the fast ones written are the 1-in-50 sample (per VM)
    assert!(
        fast as u64 <= offered / 50 + 1,
        "{fast} fast records written: {line}"
    );
    assert!(
        fast as u64 >= offered / 50 / 2,
        "the sample is written: {fast}: {line}"
    );
}

fn sectors_in(recs: &Records, lo: u64, hi: u64) -> usize {
    recs.ios()
        .iter()
        .filter(|j| j.joined && j.disk.as_deref() == Some("vdb") && j.bytes == 4096)
        .filter(|j| (lo..hi).contains(&j.sector))
        .count()
}

#[test]
fn restarting_either_agent_mid_run_recovers() {
    // Three phases on distinct ranges of vdb: before any restart, after the guest agent
    // restarted, after the host agent restarted. The new guest agent connects in the
    // background (with back-off) and flushes every 100 ms: phase 2's records get 3 s to
    // reach the first host agent before it is restarted (without, a CI run once saw them
    // all delivered to the second one instead).
    let phase = |off_mib: u32| {
        format!(
            "fio --name=p{off_mib} --filename=/dev/vdb --rw=randwrite --bs=4k --direct=1 \
             --ioengine=psync --offset={off_mib}M --size=8M --number_ios=200 --output=/dev/null\n"
        )
    };
    let wl = format!(
        "set -e\n{}\
         kill -INT $(pidof viotrace-guest)\n\
         while pidof viotrace-guest >/dev/null; do sleep 0.1; done\n\
         eval \"set -- $VIOTRACE_GUEST_ARGS\"\n\
         viotrace-guest --json --ready-file /run/g2.ready \"$@\" >/out/guest.2.jsonl 2>/out/guest.2.log &\n\
         G2=$!\n\
         while [ ! -e /run/g2.ready ]; do sleep 0.1; done\n\
         {}\
         sleep 3\n\
         echo VIOTRACE-HOST-AGENT-RESTART\n\
         sleep 12\n\
         {}\
         sleep 2\n\
         kill -INT $G2; wait $G2\n",
        phase(0),
        phase(8),
        phase(16)
    );
    let r = run_both("joined-restart", VmConfig::default(), &wl);
    let first = r.records("joined.jsonl").unwrap();
    let second = r
        .records("joined.1.jsonl")
        .expect("the restarted host agent's joined output");
    let mib = 2048u64; // sectors per MiB
    assert_eq!(sectors_in(&first, 0, 8 * mib), 200, "phase 1 joined");
    assert_eq!(
        sectors_in(&first, 8 * mib, 16 * mib),
        200,
        "phase 2 (new guest agent) joined"
    );
    assert_eq!(
        sectors_in(&second, 16 * mib, 24 * mib),
        200,
        "phase 3 (new host agent) joined"
    );
    // Losses are counted, not silent: every agent reports its counters.
    for f in ["host.jsonl", "host.1.jsonl"] {
        let recs = r.records(f).unwrap();
        let last = recs.stats().expect("stats line");
        for k in [
            "joined",
            "unmatched_guest",
            "unmatched_host",
            "guest_produced",
            "guest_delivered",
            "lost_in_transit",
            "guest_dropped_full",
        ] {
            assert!(
                last.values.contains_key(k),
                "{f}: counter {k} missing in {last:?}"
            );
        }
    }
    let g2 = std::fs::read_to_string(r.path("guest.2.log")).unwrap_or_default();
    assert!(
        g2.contains("uplink_connects=") && g2.contains("uplink_unacked_at_exit=0"),
        "guest agent reports its uplink: {g2}"
    );
}

/// The guest agent with `--skip-points lean` (no g.kick, g.irq, g.driver_complete,
/// g.bio_complete): every request still joins on its
/// descriptor head, the stages still partition it (the guest's virtqueue add
/// stands in for its kick; push to completion is one merged stage), and the
/// transport balances.
#[test]
fn lean_guest_points_still_join_every_request() {
    use viotrace_shared::record::Point;
    let r = run_both(
        "joined-lean",
        VmConfig {
            guest_args: "--skip-points lean".into(),
            ..VmConfig::default()
        },
        MIXED,
    );
    check_run_joined(&r, 0.999);
    check_transport(&r, "vt-joined-lean");
    let joined = r.records("joined.jsonl").unwrap();
    let ios = joined.ios();
    let vdb: Vec<_> = ios
        .iter()
        .filter(|j| j.joined && j.disk.as_deref() == Some("vdb"))
        .collect();
    assert!(vdb.len() > 500, "{} joined vdb records", vdb.len());
    for j in vdb {
        for p in common::LEAN_POINTS {
            assert!(j.ts.get(p).is_none(), "{p} in {j:?}");
        }
        assert!(j.ts.get(Point::VqAdd).is_some() && j.ts.get(Point::HostPush).is_some());
    }
}
