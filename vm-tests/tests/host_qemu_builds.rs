//! End-to-end tests of the host agent on the other QEMU builds of the lab (bookworm-backports'
//! 10.0, sid's 11.x from its own root) and with its optional probes (`--pop`, `--submit`): the
//! layouts, the notification paths and where the uprobes sit.

use viotrace_shared::record::{Backend, Point};
use viotrace_vm_tests::assets::QemuBuild;
use viotrace_vm_tests::{Aio, RunResult, VmConfig};

mod common;
use common::checks::{elems, known_io_device};
use common::host_run::{check_known_io, check_known_io_kicked, check_submit_host_io, run_host};
use common::{host, KNOWN_IO};

/// --pop: h.pop from virtqueue_pop (uprobe + uretprobe on Debian's build, the USDT
/// probe on dtrace-backend builds), before the element's submit (--submit: the
/// blk_aio_* call).
#[test]
fn pop_probe_gives_h_pop() {
    check_pop_submit("host-pop", QemuBuild::default());
}

/// The same on bookworm-backports' QEMU 10.0, whose probe targets start as 7.2's.
#[test]
fn qemu_10_0_pop_and_submit_on_emulated_sites() {
    check_pop_submit("host-pop-10.0", QemuBuild::V10_0);
}

/// `--pop --submit` on `qemu`: exact KNOWN_IO records, h.pop before h.submit on
/// each, and the probes on the sites of Debian's 7.2 and 10.0 builds.
fn check_pop_submit(name: &str, qemu: QemuBuild) {
    let r = run_host(
        name,
        VmConfig {
            qemu,
            host_args: vec!["--pop".into(), "--submit".into()],
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    check_known_io(&r, Backend::Threads);
    check_submit_host_io(&r);
    // virtqueue_pop starts with a movabs and blk_aio_preadv with a sub: probed
    // there, each hit would take a single-step. The probes sit on the first
    // instruction the kernel emulates that still sees the arguments.
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    let placed = assert_sites(
        &log,
        &[
            "virtqueue_pop +0x15 (jne)",
            "blk_aio_preadv +0xb (js)",
            "blk_aio_pwritev +0xb (js)",
            "blk_aio_flush +0x10 (push)",
        ],
    );
    assert!(!placed.contains("virtqueue_push"), "{placed}");
    let stepped = log
        .lines()
        .find(|l| l.contains("uprobes single-stepped"))
        .unwrap_or_default();
    assert!(
        !stepped.contains("virtqueue_pop") && !stepped.contains("preadv"),
        "{stepped}"
    );
    let all = elems(&r);
    for v in known_io_device(&all) {
        let pop =
            v.ts.get(Point::HostPop)
                .unwrap_or_else(|| panic!("h.pop: {v:?}"));
        let submit =
            v.ts.get(Point::HostSubmit)
                .unwrap_or_else(|| panic!("h.submit: {v:?}"));
        assert!(pop <= submit, "{v:?}");
    }
}

/// The host agent log's line of uprobes placed past their entry, which names
/// each of `sites` ("virtqueue_pop +0x15 (jne)").
fn assert_sites<'a>(log: &'a str, sites: &[&str]) -> &'a str {
    let placed = log
        .lines()
        .find(|l| l.contains("uprobes placed past their entry"))
        .unwrap_or_else(|| panic!("no placement line:\n{log}"));
    for site in sites {
        assert!(placed.contains(site), "{site}: {placed}");
    }
    placed
}

/// The attach line of the host agent's log for the VM.
fn attach_line(r: &RunResult) -> String {
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    log.lines()
        .find(|l| l.contains("viotrace-host: tracing pid"))
        .unwrap_or_else(|| panic!("no attach line:\n{log}"))
        .to_string()
}

/// bookworm-backports' QEMU 10.0 (Debian 13's line): the 10.0 layout, its VirtQueue
/// offsets and VirtIOBlock.blk confirmed from the binary's code, exact KNOWN_IO
/// records, with the io_uring backend (its SQE copy is at the 10.0 offset).
#[test]
fn qemu_10_0_exact_records() {
    let r = run_host(
        "host-qemu-10.0",
        VmConfig {
            qemu: QemuBuild::V10_0,
            aio: Aio::IoUring,
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    assert!(r.qemu_version.starts_with("10.0."), "{}", r.qemu_version);
    let line = attach_line(&r);
    assert!(line.contains("layout of QEMU 10.0-10.1"), "{line}");
    assert!(line.contains("VirtIOBlock.blk"), "{line}");
    assert!(!line.contains("not confirmed"), "{line}");
    check_known_io(&r, Backend::IoUring);
    let all = elems(&r);
    let recs = known_io_device(&all);
    let with_io = recs
        .iter()
        .filter(|v| v.ts.get(Point::HostIoIssue).is_some())
        .count();
    assert_eq!(with_io, recs.len(), "io_uring SQEs matched on 10.0");
    for v in &recs {
        assert_eq!(v.device, "vextra", "{v:?}");
    }
    // Served by the main loop, 10.0 raises the interrupt in virtio_notify, without the
    // guest notifier eventfd. By default that is not trapped: one uprobe hit per block
    // request (the pushes of other devices' queues aside), and the records have no h.irq,
    // each counted as such. `--irq` traps it (qemu_11_from_its_root_exact_records).
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert!(
        log.contains("h.irq only on queues whose guest notifier eventfd QEMU writes"),
        "{log}"
    );
    let v = host::final_stats(&r.out_dir).values;
    assert_eq!(v["virtio_notify_calls"], 0, "{v:?}");
    assert_eq!(v["guest_notifications"], 0, "{v:?}");
    assert!(v["irq_untraced"] >= 650, "{v:?}");
    assert_eq!(v["irq_untraced"], v["records_emitted"], "{v:?}");
    assert_eq!(
        v["uprobe_hits"] - v["push_other_device"],
        v["records_emitted"],
        "{v:?}"
    );
    assert!(recs.iter().all(|e| e.ts.get(Point::HostIrq).is_none()));
}

/// The same QEMU 10.0 with its disks served by an IOThread (as libvirt's `<driver
/// iothread=…>`): there it notifies the guest through the queue's guest notifier eventfd,
/// which a kernel tracepoint sees. Exact records, every one with h.irq (the queue's first
/// push after the agent attached may lack it, counted), one uprobe hit per block request.
/// (The IOThread polls the ring, so most requests come without a kick: no h.notify.)
#[test]
fn qemu_10_0_iothread_irq_from_the_eventfd() {
    let r = run_host(
        "host-qemu-10.0-iothread",
        VmConfig {
            qemu: QemuBuild::V10_0,
            iothread: true,
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    assert!(r.qemu_version.starts_with("10.0."), "{}", r.qemu_version);
    check_known_io_kicked(&r, Backend::Threads, false);
    let all = elems(&r);
    let recs = known_io_device(&all);
    let no_irq = recs
        .iter()
        .filter(|e| e.ts.get(Point::HostIrq).is_none())
        .count();
    assert!(no_irq <= 1, "{no_irq} of {} without h.irq", recs.len());
    for e in &recs {
        if let (Some(push), Some(irq)) = (e.ts.get(Point::HostPush), e.ts.get(Point::HostIrq)) {
            assert!(push <= irq, "{e:?}");
        }
    }
    let v = host::final_stats(&r.out_dir).values;
    assert_eq!(v["virtio_notify_calls"], 0, "{v:?}");
    assert!(v["guest_notifications"] >= 100, "{v:?}");
    // One record per push: emitted by BPF at h.irq, or by the agent's sweep of
    // pushed elements whose notification never came (a queue's first).
    assert_eq!(
        v["uprobe_hits"] - v["push_other_device"],
        v["records_emitted"] + v["emitted_without_notification"],
        "{v:?}"
    );
}

/// sid's QEMU 11.x run from its own root (a private mount namespace pivoted into a
/// debootstrapped sid: the containerised case). /proc/PID/exe names
/// /usr/bin/qemu-system-x86_64, which here is another binary (the host's 7.2): the
/// agent reads and probes it through /proc/PID/root. 11.x's layout is not from a
/// measured tree: the runtime check decides, and the records are exact (with
/// `--pop --submit` too: their probes on sid's sites).
#[test]
fn qemu_11_from_its_root_exact_records() {
    let r = run_host(
        "host-qemu-11",
        VmConfig {
            qemu: QemuBuild::V11,
            host_args: vec!["--irq".into(), "--pop".into(), "--submit".into()],
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    assert!(r.qemu_version.starts_with("11."), "{}", r.qemu_version);
    let line = attach_line(&r);
    assert!(line.contains("(via process root)"), "{line}");
    assert!(
        line.contains(&format!("/proc/{}/root/", r.qemu_pid)),
        "{line}"
    );
    assert!(line.contains("QEMU 11."), "{line}");
    assert!(line.contains("NOT known for this version"), "{line}");
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert!(!log.contains("REFUSED"), "{log}");
    // A CET build (every function starts with endbr64): the uprobes go past it, where the
    // kernel emulates the probed push instead of single-stepping, and virtqueue_pop's
    // (--pop: a uprobe and a uretprobe) on its first jne; blk_aio_preadv/pwritev copy their
    // QEMUIOVector to %rax and reload its register before their first emulated instruction,
    // the js: probed there, their program reads the vector from %rax (the attach cookie;
    // the records below are exact only if it does).
    assert_sites(
        &log,
        &[
            "virtqueue_push +0x4 (push)",
            "virtio_notify +0x4 (push)",
            "virtqueue_pop +0xf (jne)",
            "blk_aio_preadv +0x12 (js; argument 3 in rax)",
            "blk_aio_pwritev +0x12 (js; argument 3 in rax)",
        ],
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("uprobes single-stepped") && l.contains("blk_aio_p")),
        "{log}"
    );
    // 10.2+ has no virtio_notify_irqfd; served by the main loop, it raises the interrupt
    // in virtio_notify. With --irq that is trapped: every guest notification is a
    // virtio_notify on the traced queue, a second trap per request (counted as the
    // request's own), and every record has h.irq.
    let v = host::final_stats(&r.out_dir).values;
    assert!(v["guest_notifications"] >= 650, "{v:?}");
    assert_eq!(v["virtio_notify_traced"], v["guest_notifications"], "{v:?}");
    assert_eq!(v["irq_untraced"], 0, "{v:?}");
    check_known_io(&r, Backend::Threads);
    check_submit_host_io(&r);
    // The device label comes through VirtIOBlock.blk → BlockBackend.name.
    let all = elems(&r);
    for v in known_io_device(&all) {
        assert_eq!(v.device, "vextra", "{v:?}");
    }
}
