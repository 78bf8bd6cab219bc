//! "Why was this I/O slow" (issue 14), scenarios with a known injected cause, both
//! agents joined, host agent with `-t 5ms`: every joined request above the
//! threshold that is also well above its class's baseline carries a `cause`.
//!
//! - QEMU I/O throttling on the drive (`throttling.iops-total=50`): paced reads
//!   under the limit build the baseline, bursts over it are held inside QEMU
//!   before the host system call: the verdict must be `qemu_queue`.
//! - The same workload without throttling: almost nothing is flagged.

use serde_json::Value;
use viotrace_vm_tests::{Agents, VmConfig};

mod common;
use common::run_agents;

const THRESHOLD_NS: u64 = 5_000_000;

/// Four rounds of 40 reads paced at 25/s (under the limit) and a burst of 12
/// back-to-back reads (over it once the bucket's burst allowance is used).
const PACED_AND_BURSTS: &str = "sleep 1
for r in 1 2 3 4; do
  fio --name=paced$r --filename=/dev/vdb --rw=randread --bs=4k --direct=1 --ioengine=psync \
      --rate_iops=25 --number_ios=40 --size=32M --output=/dev/null
  fio --name=burst$r --filename=/dev/vdb --rw=randread --bs=4k --direct=1 --ioengine=psync \
      --number_ios=12 --size=32M --output=/dev/null
done
sleep 2
";

fn run(name: &str, qemu_args: Vec<String>) -> (Vec<Value>, String) {
    let r = run_agents(
        name,
        Agents::Both,
        VmConfig {
            host_args: vec!["-t".into(), "5ms".into()],
            qemu_args,
            ..VmConfig::default()
        },
        PACED_AND_BURSTS,
    );
    let hlog = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert_eq!(r.host_agent_rc, Some(0), "host agent:\n{hlog}");
    assert_eq!(r.guest_agent_rc, Some(0), "guest agent");
    let vdb: Vec<Value> = r
        .jsonl("joined.jsonl")
        .expect("joined.jsonl")
        .into_iter()
        .filter(|j| j["joined"] == true && j["disk"] == "vdb" && j["op"] == "read")
        .collect();
    assert!(vdb.len() >= 200, "too few joined vdb reads: {}", vdb.len());
    (vdb, hlog)
}

fn slow(recs: &[Value]) -> Vec<&Value> {
    recs.iter()
        .filter(|j| j["total_ns"].as_i64().unwrap_or(0) >= THRESHOLD_NS as i64)
        .collect()
}

#[test]
fn qemu_throttling_is_named_as_the_cause_and_a_clean_run_is_not_flagged() {
    let (rec, hlog) = run(
        "why-throttle",
        vec!["-set".into(), "drive.extra.throttling.iops-total=50".into()],
    );
    let slow = slow(&rec);
    let named = slow
        .iter()
        .filter(|j| j["cause"]["kind"] == "qemu_queue")
        .count();
    let kinds: Vec<&Value> = slow.iter().map(|j| &j["cause"]["kind"]).collect();
    eprintln!(
        "throttled: {} reads, {} above 5 ms, {named} named qemu_queue; causes {kinds:?}",
        rec.len(),
        slow.len()
    );
    assert!(
        slow.len() >= 12,
        "the bursts were not throttled: {}",
        slow.len()
    );
    assert!(
        named * 10 >= slow.len() * 9,
        "{named} of {} slow reads named qemu_queue: {kinds:?}",
        slow.len()
    );
    let example = slow
        .iter()
        .find(|j| j["cause"]["kind"] == "qemu_queue")
        .unwrap();
    assert_eq!(example["cause"]["stage"], "host_io.queue", "{example}");
    assert!(
        example["cause"]["evidence"]
            .as_str()
            .is_some_and(|e| e.contains("over its baseline")),
        "{example}"
    );
    assert!(
        hlog.contains("viotrace why-slow") && hlog.contains("cause: qemu_queue"),
        "host log has neither the causes table nor a waterfall verdict:\n{hlog}"
    );

    let (clean, _) = run("why-clean", Vec::new());
    let flagged = clean.iter().filter(|j| j["cause"].is_object()).count();
    eprintln!("clean: {} reads, {flagged} flagged", clean.len());
    assert!(
        flagged * 20 < clean.len(),
        "{flagged} of {} reads flagged without throttling",
        clean.len()
    );
}
