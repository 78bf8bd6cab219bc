//! The compatibility matrix (issue 9): both agents on guest kernels 5.10, 6.1, 6.12 and sid's
//! newest on QEMU 7.2, and guest 6.1 on QEMU 10.0 and on sid's 11.x run from its own root.
//! In every cell each guest request has its joined record, no stage is below minus the
//! clock uncertainty, and the host agent's elements match the known workload exactly.

use viotrace_vm_tests::assets::{GuestKernel, QemuBuild};
use viotrace_vm_tests::{Agents, VmConfig};

mod common;
use common::checks::{check_run_joined, check_transport, elems, known_io_device};
use common::{run_agents, KNOWN_IO};

fn cell(name: &str, guest_kernel: GuestKernel, qemu: QemuBuild) {
    let r = run_agents(
        name,
        Agents::Both,
        VmConfig {
            guest_kernel,
            qemu,
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    let hlog = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    let glog = std::fs::read_to_string(r.path("guest.log")).unwrap_or_default();
    assert_eq!(r.host_agent_rc, Some(0), "host agent:\n{hlog}");
    assert_eq!(r.guest_agent_rc, Some(0), "guest agent:\n{glog}");
    check_run_joined(&r, 1.0);
    // Every record the guest produced was delivered: 0 counted losses, on both sides.
    check_transport(&r, &format!("vt-{name}"));
    // The host agent saw exactly the workload's elements on vdb.
    let all = elems(&r);
    let vdb = known_io_device(&all);
    assert!(
        vdb.iter().all(|e| e.qemu_pid == r.qemu_pid),
        "host elements of another QEMU"
    );
}

#[test]
fn guest_5_10_on_qemu_7_2() {
    cell("matrix-5.10-q7.2", GuestKernel::V5_10, QemuBuild::V7_2);
}

#[test]
fn guest_6_1_on_qemu_7_2() {
    cell("matrix-6.1-q7.2", GuestKernel::V6_1, QemuBuild::V7_2);
}

#[test]
fn guest_6_12_on_qemu_7_2() {
    cell("matrix-6.12-q7.2", GuestKernel::V6_12, QemuBuild::V7_2);
}

#[test]
fn guest_sid_on_qemu_7_2() {
    cell("matrix-sid-q7.2", GuestKernel::V7, QemuBuild::V7_2);
}

#[test]
fn guest_6_1_on_qemu_10_0() {
    cell("matrix-6.1-q10.0", GuestKernel::V6_1, QemuBuild::V10_0);
}

#[test]
fn guest_6_1_on_qemu_11_from_its_root() {
    cell("matrix-6.1-q11", GuestKernel::V6_1, QemuBuild::V11);
}
