//! Guest instructions counted by QEMU (`--insn-count`, `insn.rs`): a fio job between two
//! marks, without and with the guest agent. The agent's BPF programs and trampolines run in
//! the module area, its thread in user space: both show per I/O.

use viotrace_vm_tests::insn::{self, Counts};
use viotrace_vm_tests::{Agents, RunResult, VmConfig};

mod common;
use common::run_agents;

const IOS: u64 = 2000;

fn workload() -> String {
    format!(
        "set -e\nfio --name=r --filename=/dev/vdb --rw=randread --bs=4k --direct=1 \
         --ioengine=psync --size=32M --number_ios={IOS} --randrepeat=0 --output=/dev/null {}\n",
        insn::FIO_MARKS
    )
}

/// The run's one window, per I/O.
fn per_io(r: &RunResult) -> Counts {
    let w = insn::run_windows(&r.out_dir).expect("marks file");
    assert_eq!(w.len(), 1, "one fio job, one window: {w:?}");
    w[0].per(IOS)
}

#[test]
fn the_guest_agents_instructions_per_io_are_counted() {
    let cfg = VmConfig {
        insn_count: true,
        guest_json: false,
        ..VmConfig::default()
    };
    let none = per_io(&run_agents(
        "insn-none",
        Agents::None,
        cfg.clone(),
        &workload(),
    ));
    let agent = run_agents("insn-guest", Agents::Guest, cfg, &workload());
    assert_eq!(agent.guest_agent_rc, Some(0), "guest agent exit status");
    let agent = per_io(&agent);
    eprintln!("per I/O: none {none}\nper I/O: guest agent {agent}");
    // A 4 KiB direct read through psync, the guest kernel and virtio-blk: thousands of
    // instructions, not none and not millions.
    assert!(
        (2_000.0..2_000_000.0).contains(&none.total()),
        "untraced: {none}"
    );
    assert!(none.user > 0.0 && none.kernel > 0.0, "untraced: {none}");
    // The agent's programs (a dozen per I/O) and its trampolines, in the module area.
    assert!(
        agent.modules - none.modules > 300.0,
        "module area: {} with the agent, {} without",
        agent.modules,
        none.modules
    );
    assert!(
        agent.total() > none.total(),
        "with the agent {agent}, without {none}"
    );
}
