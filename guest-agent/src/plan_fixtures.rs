//! The facts of the Debian guest kernels the plan's unit tests use (function
//! locations in the cloud kernels, /sys/kernel/btf, and tracepoint prototypes
//! read from each kernel's BTF).

use std::collections::HashSet;

use viotrace_shared::record::Point;

use super::{Flavour, Plan, VDEV_IRQ_HANDLERS};
use crate::kernel::Facts;
use crate::probe::{Sym, SYSCALLS};

pub(super) const VIRTIO_BLK: &[&str] = &["virtio_queue_rq", "virtio_queue_rqs"];
pub(super) const VIRTIO_RING: &[&str] = &[
    "virtqueue_add_sgs",
    "virtqueue_kick_prepare",
    "virtqueue_notify",
    "vring_interrupt",
];
pub(super) const CORE: &[&str] = &[
    "blk_mq_complete_request",
    "aio_prep_rw",
    "blk_update_request",
];

pub(super) fn args(a: &[Option<&str>]) -> Vec<Option<String>> {
    a.iter().map(|x| x.map(str::to_string)).collect()
}

/// Facts of a Debian cloud kernel: `ring_builtin` (6.12+), `rqs` (virtio_queue_rqs, 5.19+),
/// `btf` (/sys/kernel/btf entries), `tps` (tracepoint → pointee struct names).
pub(super) fn kernel(
    release: &str,
    ring_builtin: bool,
    rqs: bool,
    btf: &[&str],
    tps: &[(&str, &[Option<&str>])],
) -> Facts {
    let mut syms = std::collections::HashMap::new();
    let mut addr = 0xffff_ffff_c000_0000u64;
    let mut add = |name: &str, module: &str| {
        addr += 0x100;
        syms.insert(
            name.to_string(),
            Sym {
                module: module.to_string(),
                addr,
            },
        );
    };
    for f in VIRTIO_BLK {
        if *f != "virtio_queue_rqs" || rqs {
            add(f, "virtio_blk");
        }
    }
    for f in VIRTIO_RING {
        add(
            f,
            if ring_builtin {
                "vmlinux"
            } else {
                "virtio_ring"
            },
        );
    }
    // (virtio_pci is built in where virtio_ring is; virtio_mmio not loaded)
    for f in &VDEV_IRQ_HANDLERS[..2] {
        add(
            f,
            if ring_builtin {
                "vmlinux"
            } else {
                "virtio_pci"
            },
        );
    }
    for f in CORE.iter().chain(&crate::plan::TYPED_FILE_TARGETS) {
        add(f, "vmlinux");
    }
    for s in SYSCALLS {
        add(s.target, "vmlinux");
    }
    Facts {
        release: release.to_string(),
        fentry: true,
        kprobes: true,
        syms,
        btf: btf.iter().map(|s| s.to_string()).collect(),
        tracepoints: tps.iter().map(|(n, a)| (n.to_string(), args(a))).collect(),
        sys_untyped_regs: Default::default(),
    }
}

pub(super) const IRQ: (&str, &[Option<&str>]) = ("irq_handler_entry", &[None, Some("irqaction")]);

pub(super) fn k5_10() -> Facts {
    kernel(
        "5.10.0-46-cloud-amd64",
        false,
        false,
        &["vmlinux"],
        &[
            ("block_bio_queue", &[Some("request_queue"), Some("bio")]),
            ("io_uring_submit_sqe", &[None; 7]),
            IRQ,
        ],
    )
}

pub(super) fn k6_1() -> Facts {
    kernel(
        "6.1.0-56-cloud-amd64",
        false,
        true,
        &["vmlinux", "virtio_blk", "virtio_ring"],
        &[
            ("block_bio_queue", &[Some("bio")]),
            ("io_uring_submit_sqe", &[Some("io_kiocb"), None]),
            IRQ,
        ],
    )
}

pub(super) fn k7_2() -> Facts {
    kernel(
        "7.2.13+deb14-cloud-amd64",
        true,
        true,
        &["vmlinux", "virtio_blk"],
        &[
            ("block_bio_queue", &[Some("bio")]),
            ("io_uring_submit_req", &[Some("io_kiocb")]),
            IRQ,
        ],
    )
}

/// Everything the plan enables loaded and attached.
pub(super) fn all_live(p: &Plan) -> HashSet<String> {
    p.programs().iter().map(|s| s.to_string()).collect()
}

pub(super) fn flavour(p: &Plan, target: &str) -> Option<Flavour> {
    p.choice(target).unwrap().flavour
}

pub(super) const DRIVER_POINTS: [Point; 6] = [
    Point::QueueRq,
    Point::VqAdd,
    Point::Kick,
    Point::Irq,
    Point::DriverComplete,
    Point::BioComplete,
];
