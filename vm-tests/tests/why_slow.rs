//! "Why was this I/O slow" (issue 14), scenarios with a known injected cause, both
//! agents joined, host agent with `-t 5ms`: every joined request above the
//! threshold that is also well above its class's baseline carries a `cause`.
//!
//! - QEMU I/O throttling on the drive (`throttling.iops-total=50`): paced reads
//!   under the limit build the baseline, bursts over it are held inside QEMU
//!   before the host system call: the verdict must be `qemu_queue`.
//! - The same workload without throttling: almost nothing is flagged.

use viotrace_shared::cause::CauseKind;
use viotrace_shared::record::{JoinedIo, Op};
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

fn run(name: &str, qemu_args: Vec<String>) -> (Vec<JoinedIo>, String) {
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
    let joined = r.records("joined.jsonl").expect("joined.jsonl");
    let vdb: Vec<JoinedIo> = joined
        .ios()
        .into_iter()
        .filter(|j| j.joined && j.disk.as_deref() == Some("vdb") && j.op == Op::Read)
        .cloned()
        .collect();
    assert!(vdb.len() >= 200, "too few joined vdb reads: {}", vdb.len());
    (vdb, hlog)
}

fn kind(j: &JoinedIo) -> Option<CauseKind> {
    j.cause.as_ref().map(|c| c.kind)
}

fn slow(recs: &[JoinedIo]) -> Vec<&JoinedIo> {
    recs.iter()
        .filter(|j| j.total_ns.unwrap_or(0) >= THRESHOLD_NS as i64)
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
        .filter(|j| kind(j) == Some(CauseKind::QemuQueue))
        .count();
    let kinds: Vec<Option<CauseKind>> = slow.iter().map(|j| kind(j)).collect();
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
        .find(|j| kind(j) == Some(CauseKind::QemuQueue))
        .unwrap();
    let cause = example.cause.as_ref().unwrap();
    assert_eq!(cause.stage, "host_io.queue", "{example:?}");
    assert!(cause.evidence.contains("over its baseline"), "{example:?}");
    assert!(
        hlog.contains("viotrace why-slow") && hlog.contains("cause: qemu_queue"),
        "host log has neither the causes table nor a waterfall verdict:\n{hlog}"
    );

    let (clean, _) = run("why-clean", Vec::new());
    let flagged = clean.iter().filter(|j| j.cause.is_some()).count();
    eprintln!("clean: {} reads, {flagged} flagged", clean.len());
    assert!(
        flagged * 20 < clean.len(),
        "{flagged} of {} reads flagged without throttling",
        clean.len()
    );
}
