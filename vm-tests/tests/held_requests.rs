//! A request the host holds for seconds while the rest of the queue keeps flowing: QEMU's
//! blkdebug driver suspends one read (qemu-io `break`) and lets it go 4 s later (`resume`).
//! Its kick must not be lost to the kicks that came after it.

use viotrace_shared::record::{GuestRq, Op, Point};
use viotrace_vm_tests::{Agents, VmConfig};

mod common;
use common::guest::counter;
use common::run_agents;

/// How long the workload holds the read, and the least the test accepts as held.
const HELD_SECS: u64 = 4;
const HELD_MIN_NS: u64 = 3_000_000_000;

const WORKLOAD: &str = "set -e\n\
    fio --name=prep --filename=/data/held.dat --size=32M --rw=write --bs=1M --direct=1 \
    --output=/dev/null\n\
    fio --name=r --filename=/data/held.dat --size=32M --rw=randread --bs=4k --ioengine=libaio \
    --iodepth=16 --direct=1 --runtime=9 --time_based --output=/out/fio.txt &\n\
    sleep 2\n\
    echo VIOTRACE-QEMU-IO break read_aio held\n\
    sleep 4\n\
    echo VIOTRACE-QEMU-IO resume held\n\
    wait\n";

/// The device time of a request: virtqueue add to completion, guest clock.
fn device_ns(v: &GuestRq) -> Option<u64> {
    let (a, c) = (v.ts.get(Point::VqAdd)?, v.ts.get(Point::RqComplete)?);
    c.checked_sub(a)
}

#[test]
fn a_read_held_for_seconds_keeps_its_kick() {
    let cfg = VmConfig {
        blkdebug: true,
        ..VmConfig::default()
    };
    let r = run_agents("held-read", Agents::Guest, cfg, WORKLOAD);
    assert_eq!(r.guest_agent_rc, Some(0), "guest agent exit status");
    let qemu_io = std::fs::read_to_string(r.path("qemu-io.txt")).expect("qemu-io.txt");
    assert_eq!(qemu_io.lines().count(), 2, "{qemu_io}");
    assert!(!qemu_io.contains("FAILED"), "{qemu_io}");

    let recs = r.records("guest.jsonl").expect("guest.jsonl");
    let rqs: Vec<&GuestRq> = recs
        .guest_rqs()
        .into_iter()
        .filter(|v| v.disk == "vda" && v.op == Op::Read)
        .collect();
    let held: Vec<&&GuestRq> = rqs
        .iter()
        .filter(|v| device_ns(v).is_some_and(|d| d >= HELD_MIN_NS))
        .collect();
    // One read held by the breakpoint (a few more only if the guest merged into it).
    assert!(
        !held.is_empty() && held.len() <= 4,
        "reads held ≥ {HELD_MIN_NS} ns in the device: {held:?}"
    );
    let quick = rqs.len() - held.len();
    assert!(
        quick > 1000,
        "only {quick} other reads while one was held {HELD_SECS} s: not enough kicks to wrap \
         the ring of 256"
    );
    for v in &held {
        assert!(
            v.ts.get(Point::Kick).is_some(),
            "held read without g.kick: {v:?}"
        );
        assert!(
            v.kicked.is_some(),
            "held read without its kick outcome: {v:?}"
        );
        let (add, kick) = (v.ts.get(Point::VqAdd), v.ts.get(Point::Kick));
        assert!(add <= kick, "g.kick before g.vq_add: {v:?}");
    }
    let log = std::fs::read_to_string(r.path("guest.log")).unwrap_or_default();
    assert_eq!(counter(&log, "kick_slot_lost"), 0, "{log}");
    // Every other read has its kick too (none completed before it, at QD16 under TCG).
    let without: Vec<&&GuestRq> = rqs
        .iter()
        .filter(|v| v.ts.get(Point::Kick).is_none())
        .collect();
    assert!(
        without.len() as u64 <= counter(&log, "kick_after_completion"),
        "{} reads without g.kick: {:?}",
        without.len(),
        without.first()
    );
}
