//! Plans and reports for the Debian guest kernels, from their real facts
//! (function locations in the cloud kernels, /sys/kernel/btf, and tracepoint
//! prototypes read from each kernel's BTF).

use std::collections::{BTreeMap, HashSet};

use super::fixtures::*;
use super::*;
use crate::probe::SYSCALLS;

#[test]
fn linux_5_10_fentry_falls_back_to_kprobes_for_modules_without_btf() {
    let f = k5_10();
    let p = plan(Mode::Fentry, &f);
    for t in CORE {
        assert_eq!(flavour(&p, t), Some(Flavour::Fentry), "{t}");
    }
    for t in VIRTIO_RING.iter().chain(&["virtio_queue_rq"]) {
        assert_eq!(flavour(&p, t), Some(Flavour::Kprobe), "{t}");
    }
    assert_eq!(flavour(&p, "virtio_queue_rqs"), None);
    assert!(p
        .notes
        .iter()
        .any(|n| n.starts_with("virtio_queue_rq: no BTF for virtio_blk")));
    assert_eq!(
        p.variants,
        Variants {
            tp_bio_has_queue: true,
            tp_uring_sqe_req_pos: 1,
            vvq_assume_layout: true,
            vring_interrupt_addr: f.syms["vring_interrupt"].addr,
            vdev_irq_handlers: [0; 3],
        }
    );
    assert_eq!(p.uring, Ok("uring_submit_sqe"));
    let progs = p.programs();
    for prog in [
        "fx_update_request",
        "fe_complete_request",
        "fe_aio_prep_rw",
        "kp_queue_rq",
        "kp_add_sgs",
        "kp_kick_prepare",
        "krp_kick_prepare",
        "irq_entry",
        "uring_submit_sqe",
    ] {
        assert!(progs.contains(prog), "{prog} in {progs:?}");
    }
    assert!(!progs.contains("kp_queue_rqs") && !progs.contains("fe_queue_rqs"));
    // All of it attached: nothing is blind (the batched path does not exist on 5.10).
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert_eq!(r.blind_points, Vec::<Point>::new());
    assert_eq!(r.blind, Vec::<String>::new());
}

#[test]
fn linux_5_10_tracepoint_mode_is_blind_to_the_driver_points_only() {
    let f = k5_10();
    let p = plan(Mode::Tracepoint, &f);
    assert_eq!(
        p.programs().into_iter().collect::<Vec<_>>(),
        ["uring_submit_sqe"]
    );
    assert!(p.variants.tp_bio_has_queue && !p.variants.vvq_assume_layout);
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert_eq!(r.blind_points, DRIVER_POINTS);
    // One line per hook that exists on this kernel; none for the absent batched
    // path, nor for virtqueue_notify, which only --exact-kick attaches.
    assert_eq!(r.blind.len(), HOOKS.len() - 2, "{:#?}", r.blind);
    assert!(r.blind.iter().all(|l| !l.contains("batched")));
}

#[test]
fn linux_6_1_fentry_uses_module_btf_and_the_two_argument_submit_sqe() {
    let f = k6_1();
    let p = plan(Mode::Fentry, &f);
    assert!(p.hooks.iter().all(|c| c.flavour == Some(Flavour::Fentry)));
    // The one note says where the syscalls are traced.
    assert_eq!(p.notes.len(), 1, "{:?}", p.notes);
    assert!(p.notes[0].starts_with("syscalls: fentry/fexit"));
    // (the irq handlers' addresses: tb_irq_entry, below)
    let want = Variants {
        vring_interrupt_addr: p.variants.vring_interrupt_addr,
        vdev_irq_handlers: p.variants.vdev_irq_handlers,
        ..Variants::default()
    };
    assert_eq!(p.variants, want);
    assert_eq!(p.uring, Ok("tb_uring_submit_sqe"));
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert!(r.blind_points.is_empty() && r.blind.is_empty(), "{r:?}");
}

/// io_uring requests: typed (tp_btf) in fentry mode from 6.0, on whichever submit
/// tracepoint the kernel has; raw in the other modes and on 5.10 (whose backported
/// tracepoint takes the ring first); a refused typed program gives way to its raw
/// twin, with a note, and nothing goes blind.
#[test]
fn io_uring_requests_are_typed_in_fentry_mode_from_6_0() {
    assert_eq!(plan(Mode::Fentry, &k6_1()).uring, Ok("tb_uring_submit_sqe"));
    assert_eq!(plan(Mode::Fentry, &k7_2()).uring, Ok("tb_uring_submit"));
    assert_eq!(plan(Mode::Fentry, &k5_10()).uring, Ok("uring_submit_sqe"));
    assert_eq!(plan(Mode::Kprobe, &k7_2()).uring, Ok("uring_submit"));
    assert_eq!(
        plan(Mode::Tracepoint, &k6_1()).uring,
        Ok("uring_submit_sqe")
    );
    let f = k7_2();
    let mut p = plan(Mode::Fentry, &f);
    assert!(p.programs().contains("tb_uring_submit") && !p.programs().contains("uring_submit"));
    p.drop_program("tb_uring_submit");
    assert_eq!(p.uring, Ok("uring_submit"));
    assert!(p.programs().contains("uring_submit") && !p.programs().contains("tb_uring_submit"));
    assert!(p.notes.iter().any(|n| n
        == "io_uring requests: program tb_uring_submit refused by this kernel: the raw \
            tracepoint's program uring_submit instead"));
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert!(
        r.blind.iter().all(|l| !l.contains("io_uring")),
        "{:?}",
        r.blind
    );
    for (typed, raw) in URING_TYPED {
        assert!(is_optional(typed) && is_optional(raw));
    }
}

#[test]
fn linux_7_2_kprobe_mode_takes_submit_req_and_the_irq_tracepoint() {
    let f = k7_2();
    let p = plan(Mode::Kprobe, &f);
    assert!(p.hooks.iter().all(|c| c.flavour == Some(Flavour::Kprobe)));
    assert_eq!(p.uring, Ok("uring_submit"));
    assert!(p.programs().contains("irq_entry") && p.programs().contains("kp_queue_rqs"));
    assert!(!p.variants.tp_bio_has_queue && !p.variants.vvq_assume_layout);
    // vring_interrupt's kprobe failed, but irq_handler_entry still gives g.irq.
    let mut live = all_live(&p);
    live.remove("kp_vring_interrupt");
    let failed = BTreeMap::from([(
        "kp_vring_interrupt".to_string(),
        "attach: ENOENT".to_string(),
    )]);
    let r = report(&p, &f, &live, &failed);
    assert!(r.blind_points.is_empty(), "{r:?}");
}

#[test]
fn a_refused_vring_interrupt_kprobe_leaves_g_irq_to_the_irq_tracepoint() {
    let f = k7_2();
    let mut p = plan(Mode::Kprobe, &f);
    p.drop_program("kp_vring_interrupt");
    let progs = p.programs();
    assert!(!progs.contains("kp_vring_interrupt") && progs.contains("irq_entry"));
    // irq_entry still stamps g.irq into the records: the report says so.
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert!(r.blind_points.is_empty() && r.blind.is_empty(), "{r:?}");
    // Without irq_entry too, g.irq is blind, with the refusal as the reason.
    let mut live = all_live(&p);
    live.remove("irq_entry");
    let r = report(&p, &f, &live, &BTreeMap::new());
    assert_eq!(r.blind_points, [Point::Irq]);
    assert!(
        r.blind
            .iter()
            .any(|l| l.contains("kp_vring_interrupt refused")),
        "{r:?}"
    );
}

#[test]
fn a_failed_program_blinds_exactly_the_points_that_depend_on_it() {
    let f = k7_2();
    let p = plan(Mode::Fentry, &f);
    let mut live = all_live(&p);
    live.remove("fe_add_sgs");
    let failed = BTreeMap::from([("fe_add_sgs".to_string(), "load: EINVAL".to_string())]);
    let r = report(&p, &f, &live, &failed);
    assert_eq!(r.blind_points, [Point::VqAdd, Point::Kick, Point::Irq]);
    assert_eq!(
        r.blind,
        ["g.vq_add, queue index, descriptor head: program fe_add_sgs: load: EINVAL"]
    );
    // The batched path exists on 7.2: losing it blinds g.queue_rq.
    let mut live = all_live(&p);
    live.remove("fe_queue_rqs");
    let r = report(&p, &f, &live, &BTreeMap::new());
    assert_eq!(r.blind_points, [Point::QueueRq]);
}

#[test]
fn without_kprobes_or_module_btf_fentry_mode_reports_the_module_hooks_blind() {
    let mut f = k5_10();
    f.kprobes = false;
    let p = plan(Mode::Fentry, &f);
    assert_eq!(flavour(&p, "virtqueue_add_sgs"), None);
    assert_eq!(flavour(&p, "blk_update_request"), Some(Flavour::Fentry));
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert_eq!(
        r.blind_points,
        [Point::QueueRq, Point::VqAdd, Point::Kick, Point::Irq]
    );
    assert!(r.blind.iter().any(|l| l.contains("no BTF for virtio_ring")));
    // Kprobe mode without kprobes: every hook is blind, the tracepoints still run.
    let r = report(
        &plan(Mode::Kprobe, &f),
        &f,
        &HashSet::new(),
        &BTreeMap::new(),
    );
    assert_eq!(r.blind_points, DRIVER_POINTS);
}

#[test]
fn a_7x_ring_module_without_btf_has_no_head_rather_than_a_guessed_one() {
    let mut f = k7_2();
    for name in VIRTIO_RING {
        f.syms.get_mut(*name).unwrap().module = "virtio_ring".into();
    }
    let p = plan(Mode::Kprobe, &f);
    assert!(!p.variants.vvq_assume_layout);
    assert!(p.blind[0].starts_with("descriptor head"), "{:?}", p.blind);
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert!(r.blind_points.is_empty());
    assert_eq!(r.blind, p.blind);
}

#[test]
fn io_uring_generations() {
    assert_eq!(uring_sqe_req_pos(&args(&[Some("io_kiocb"), None])), Some(0));
    assert_eq!(uring_sqe_req_pos(&args(&[None; 7])), Some(1));
    // 5.11-5.14: (ctx, opcode, user_data, force_nonblock, sq_thread)
    assert_eq!(uring_sqe_req_pos(&args(&[None; 5])), None);
    let mut f = k6_1();
    f.tracepoints
        .insert("io_uring_submit_sqe".into(), args(&[None; 5]));
    let p = plan(Mode::Tracepoint, &f);
    assert!(p.uring.is_err() && !p.programs().contains("uring_submit_sqe"));
    let r = report(&p, &f, &HashSet::new(), &BTreeMap::new());
    assert!(r
        .blind
        .iter()
        .any(|l| l.starts_with("file and offset of io_uring requests: io_uring_submit_sqe")));
    f.tracepoints.remove("io_uring_submit_sqe");
    assert!(plan(Mode::Tracepoint, &f).uring.is_err());
}

#[test]
fn release_versions() {
    assert_eq!(k5_10().version(), (5, 10));
    assert_eq!(k7_2().version(), (7, 2));
    assert!(is_optional("irq_entry") && is_optional("kp_add_sgs") && !is_optional("bio_queue"));
}

#[test]
fn a_refused_program_is_dropped_with_its_hook_only() {
    let f = k7_2();
    let mut p = plan(Mode::Kprobe, &f);
    p.drop_program("krp_kick_prepare");
    p.drop_program("uring_submit");
    p.drop_program("irq_entry");
    let progs = p.programs();
    assert!(!progs.contains("kp_kick_prepare") && !progs.contains("krp_kick_prepare"));
    assert!(!progs.contains("uring_submit") && !progs.contains("irq_entry"));
    assert!(progs.contains("kp_add_sgs") && progs.contains("kp_vring_interrupt"));
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert_eq!(r.blind_points, [Point::Kick]);
    assert!(r
        .blind
        .iter()
        .any(|l| l.contains("program krp_kick_prepare refused")));
    assert!(r.blind.iter().any(|l| l.starts_with(URING_SEES)));
}

#[test]
fn virtqueue_notify_is_trapped_only_for_exact_kicks() {
    let f = k6_1();
    let mut p = plan(Mode::Fentry, &f);
    let progs = p.programs();
    assert!(progs.contains("fx_kick_prepare") && !progs.contains("fe_notify"));
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert_eq!(r.blind_points, Vec::<Point>::new());
    assert_eq!(r.blind, Vec::<String>::new());
    assert!(
        r.notes.iter().any(|n| n.contains("--exact-kick")),
        "{:#?}",
        r.notes
    );
    p.exact_kick = true;
    assert!(p.programs().contains("fe_notify"));
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert!(r.notes.iter().all(|n| !n.contains("--exact-kick")));
}

/// The syscall programs each mode runs: fentry mode puts an entry and an exit
/// program on each I/O syscall's wrapper; the others use the raw tracepoints.
#[test]
fn fentry_mode_traces_syscalls_on_their_wrappers_and_the_others_on_raw_tracepoints() {
    let f = k6_1();
    let p = plan(Mode::Fentry, &f);
    let progs = p.programs();
    assert_eq!(p.sys_fentry.len(), SYSCALLS.len());
    for s in SYSCALLS {
        assert!(
            progs.contains(s.enter) && progs.contains(s.exit),
            "{}",
            s.target
        );
    }
    assert!(
        p.notes.iter().any(|n| n.starts_with(&format!(
            "syscalls: fentry/fexit on {} syscall wrappers",
            SYSCALLS.len()
        ))),
        "{:#?}",
        p.notes
    );
    for m in [Mode::Kprobe, Mode::Tracepoint] {
        let p = plan(m, &f);
        assert!(p.sys_fentry.is_empty(), "{m}");
        assert!(!p.programs().iter().any(|p| is_sys_fentry(p)), "{m}");
    }
}

/// A kernel without io_uring has no io_uring_enter to trace; one without vmlinux
/// BTF, or without the wrappers, keeps the raw tracepoints; a refused syscall
/// program sends every syscall back to them (never some syscalls on each).
#[test]
fn syscall_programs_fall_back_to_the_raw_tracepoints_as_a_whole() {
    let mut f = k7_2();
    f.syms.remove("__x64_sys_io_uring_enter");
    let mut p = plan(Mode::Fentry, &f);
    assert_eq!(p.sys_fentry.len(), SYSCALLS.len() - 1);
    assert!(!p.programs().contains("fe_sys_io_uring_enter"));
    assert!(p
        .notes
        .iter()
        .any(|n| n.ends_with("not in this kernel: __x64_sys_io_uring_enter")));
    p.drop_program("fx_sys_pread64");
    assert!(p.sys_fentry.is_empty());
    assert!(!p.programs().iter().any(|p| is_sys_fentry(p)));
    assert!(p.notes.iter().any(|n| n
        == "syscalls: program fx_sys_pread64 refused by this kernel: the raw \
            sys_enter/sys_exit tracepoints instead"));
    // The note on the wrappers went with them (it no longer holds).
    assert!(!p
        .notes
        .iter()
        .any(|n| n.starts_with("syscalls: fentry/fexit on")));
    // Only a syscall program's refusal does that.
    let mut p = plan(Mode::Fentry, &f);
    p.drop_program("fe_add_sgs");
    assert_eq!(p.sys_fentry.len(), SYSCALLS.len() - 1);

    let mut no_btf = k7_2();
    no_btf.btf.remove("vmlinux");
    assert!(plan(Mode::Fentry, &no_btf).sys_fentry.is_empty());
    let mut no_wrappers = k7_2();
    no_wrappers.syms.retain(|k, _| !k.starts_with("__x64_sys_"));
    let p = plan(Mode::Fentry, &no_wrappers);
    assert!(p.sys_fentry.is_empty());
    assert!(p
        .notes
        .iter()
        .any(|n| n.starts_with("syscalls: no __x64_sys_* wrapper")));
    // A wrapper whose argument the BTF leaves untyped (Debian 5.10's
    // io_submit) is known to be refused: the tracepoints from the start.
    let mut untyped = k7_2();
    untyped
        .sys_untyped_regs
        .insert("__x64_sys_io_submit".into());
    let p = plan(Mode::Fentry, &untyped);
    assert!(p.sys_fentry.is_empty());
    assert!(p.notes.iter().any(
        |n| n.starts_with("syscalls: __x64_sys_io_submit's struct pt_regs argument is untyped")
    ));
}

/// Bios and requests: fentry mode with vmlinux BTF traces them on a typed bio
/// or request (tp_btf; the request ones from 5.11); the other modes, a kernel
/// without vmlinux BTF, or a refused typed program keep the raw tracepoint's
/// program (always loaded, attached when needed).
#[test]
fn bios_and_requests_are_typed_in_fentry_mode_else_on_the_raw_tracepoints() {
    let all: BTreeSet<&str> = TYPED_TPS.iter().map(|t| t.typed).collect();
    for f in [k5_10(), k6_1(), k7_2()] {
        let p = plan(Mode::Fentry, &f);
        let want: BTreeSet<&str> = if f.version() < (5, 11) {
            BTreeSet::from(["tb_bio_queue"])
        } else {
            all.clone()
        };
        assert_eq!(p.typed_tps, want, "{}", f.release);
        assert!(
            want.iter().all(|t| p.programs().contains(t)),
            "{}",
            f.release
        );
        for m in [Mode::Kprobe, Mode::Tracepoint] {
            let p = plan(m, &f);
            assert!(
                p.typed_tps.is_empty() && p.programs().is_disjoint(&all),
                "{m}"
            );
        }
    }
    let mut no_btf = k6_1();
    no_btf.btf.remove("vmlinux");
    assert!(plan(Mode::Fentry, &no_btf).typed_tps.is_empty());
    let mut p = plan(Mode::Fentry, &k6_1());
    p.drop_program("tb_rq_issue");
    assert!(!p.programs().contains("tb_rq_issue"));
    assert!(p.programs().contains("tb_rq_insert") && p.programs().contains("tb_bio_queue"));
    assert!(p.notes.iter().any(|n| n
        == "block_rq_issue: program tb_rq_issue refused by this kernel: the raw tracepoint's \
            program rq_issue instead"));
    for TypedTp { typed, raw, .. } in TYPED_TPS {
        assert!(is_optional(typed) && !is_optional(raw), "{typed}");
    }
}

/// Reads' and writes' files: typed at vfs_read/vfs_write wherever bios are
/// typed and both functions are in vmlinux; a refused program, or a kernel
/// without one of them, leaves them to the syscall's entry (not blind).
#[test]
fn read_and_write_files_come_typed_in_fentry_mode_else_from_the_fd() {
    for f in [k5_10(), k6_1(), k7_2()] {
        let p = plan(Mode::Fentry, &f);
        assert!(p.typed_file, "{}", f.release);
        assert!(TYPED_FILE_PROGS.iter().all(|t| p.programs().contains(t)));
        for m in [Mode::Kprobe, Mode::Tracepoint] {
            let p = plan(m, &f);
            assert!(
                !p.typed_file && !p.programs().contains("fe_vfs_read"),
                "{m}"
            );
        }
    }
    let mut no_vfs_write = k6_1();
    no_vfs_write.syms.remove("vfs_write");
    assert!(!plan(Mode::Fentry, &no_vfs_write).typed_file);
    let mut p = plan(Mode::Fentry, &k6_1());
    p.drop_program("fe_vfs_write");
    assert!(!p.typed_file);
    assert!(TYPED_FILE_PROGS.iter().all(|t| !p.programs().contains(t)));
    assert!(p.notes.iter().any(|n| n
        == "read/write files: program fe_vfs_write refused by this kernel: resolved from the \
            fd at the syscall's entry"));
    let r = report(&p, &k6_1(), &all_live(&p), &BTreeMap::new());
    assert!(r.blind.is_empty() && r.blind_points.is_empty(), "{r:?}");
    assert!(TYPED_FILE_PROGS.iter().all(|t| is_optional(t)));
}

#[test]
fn skip_points_reads_names_short_names_and_lean_and_refuses_the_others() {
    let read = |s: &str| s.parse::<SkipPoints>().map(|p| p.0);
    assert_eq!(read("g.kick"), Ok(vec![Point::Kick]));
    assert_eq!(
        read("kick, g.irq,kick"),
        Ok(vec![Point::Kick, Point::Irq]),
        "short names, spaces, repeats"
    );
    assert_eq!(
        read("irq,lean").unwrap().len(),
        LEAN.len(),
        "lean has g.irq"
    );
    assert_eq!(read("lean"), Ok(LEAN.to_vec()));
    assert_eq!(
        read("queue_rq,lean").unwrap().len(),
        LEAN.len() + 1,
        "lean and more"
    );
    for (bad, says) in [
        ("g.vq_add", "cannot be left out"),
        ("rq_issue", "cannot be left out"),
        ("g.syscall_enter", "cannot be left out"),
        ("g.rq_insert", "cannot be left out"),
        ("h.pop", "cannot be left out"),
        ("g.nope", "no point"),
        ("", "no point named"),
        (",", "no point named"),
    ] {
        let e = read(bad).expect_err(bad);
        assert!(e.contains(says), "{bad}: {e}");
    }
}

/// `--skip-points lean` on 6.1 in fentry mode: its points' programs are not
/// loaded and the report names them blind, each with its reason; the virtqueue
/// add (the join key) and the queue_rq hook stay.
#[test]
fn skipped_points_leave_their_programs_out_and_are_reported_blind() {
    let f = k6_1();
    let mut p = plan(Mode::Fentry, &f);
    p.skip_points(LEAN);
    let progs = p.programs();
    for gone in [
        "fx_kick_prepare",
        "fe_vring_interrupt",
        "fe_complete_request",
        "fx_update_request",
    ] {
        assert!(!progs.contains(gone), "{gone} in {progs:?}");
    }
    for kept in [
        "fe_add_sgs",
        "fe_queue_rq",
        "fe_queue_rqs",
        "fe_aio_prep_rw",
    ] {
        assert!(progs.contains(kept), "{kept} not in {progs:?}");
    }
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert_eq!(
        r.blind_points,
        [
            Point::Kick,
            Point::Irq,
            Point::DriverComplete,
            Point::BioComplete
        ]
    );
    for why in [
        "g.kick and whether it notified or was suppressed: left out (--skip-points g.kick)",
        "g.driver_complete: left out (--skip-points g.driver_complete)",
        "g.bio_complete: left out (--skip-points g.bio_complete)",
    ] {
        assert!(
            r.blind.iter().any(|l| l == why),
            "{why} not in {:#?}",
            r.blind
        );
    }
    // (g.irq is left out twice over; the line names one of them)
    assert!(
        r.blind
            .iter()
            .any(|l| l.starts_with("g.irq: left out (--skip-points g.")),
        "{:#?}",
        r.blind
    );
    assert!(
        !r.notes.iter().any(|n| n.starts_with("g.kick:")),
        "{:?}",
        r.notes
    );
    // Without it, the same plan leaves nothing out.
    let full = plan(Mode::Fentry, &f);
    assert!(report(&full, &f, &all_live(&full), &BTreeMap::new())
        .blind_points
        .is_empty());
}

/// In fentry mode g.irq comes from the irq_handler_entry tracepoint, typed,
/// where kallsyms names virtio-pci's handlers; refused, or without them, from
/// vring_interrupt's trampoline.
#[test]
fn fentry_mode_takes_g_irq_on_the_irq_tracepoint_where_the_handlers_are_named() {
    for f in [k6_1(), k7_2()] {
        let mut p = plan(Mode::Fentry, &f);
        let progs = p.programs();
        assert!(progs.contains(TYPED_IRQ_PROG), "{progs:?}");
        assert!(!progs.contains("fe_vring_interrupt") && !progs.contains("irq_entry"));
        let addr = |n: &str| f.syms[n].addr;
        assert_eq!(p.variants.vring_interrupt_addr, addr("vring_interrupt"));
        let want = [addr("vp_vring_interrupt"), addr("vp_interrupt"), 0];
        assert_eq!(p.variants.vdev_irq_handlers, want);
        let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
        assert!(r.blind_points.is_empty(), "{:?}", r.blind);
        // Not attached: g.irq blind, and the report names the program and its error.
        let mut live = all_live(&p);
        live.remove(TYPED_IRQ_PROG);
        let failed = BTreeMap::from([(TYPED_IRQ_PROG.to_string(), "attach failed: x".to_string())]);
        let r = report(&p, &f, &live, &failed);
        assert_eq!(r.blind_points, [Point::Irq]);
        assert!(
            r.blind
                .iter()
                .any(|l| l.ends_with("program tb_irq_entry: attach failed: x")),
            "{:#?}",
            r.blind
        );
        // Refused: the trampoline instead, and a note says why.
        p.drop_program(TYPED_IRQ_PROG);
        let progs = p.programs();
        assert!(progs.contains("fe_vring_interrupt") && !progs.contains(TYPED_IRQ_PROG));
        assert_eq!(p.variants.vring_interrupt_addr, 0);
        assert!(p
            .notes
            .iter()
            .any(|n| n.starts_with("g.irq: program tb_irq_entry")));
        assert!(report(&p, &f, &all_live(&p), &BTreeMap::new())
            .blind_points
            .is_empty());
    }
    // A kernel whose kallsyms lacks a shared handler: the trampoline.
    let mut f = k6_1();
    f.syms.remove("vp_interrupt");
    let p = plan(Mode::Fentry, &f);
    assert!(p.programs().contains("fe_vring_interrupt") && !p.typed_irq);
    assert_eq!(p.variants.vdev_irq_handlers, [0; 3]);
    // Left out: neither program.
    let mut p = plan(Mode::Fentry, &k6_1());
    p.skip_points(&[Point::Irq]);
    let progs = p.programs();
    assert!(!progs.contains(TYPED_IRQ_PROG) && !progs.contains("fe_vring_interrupt"));
}

/// In kprobe mode g.irq comes from the irq_handler_entry tracepoint: leaving
/// g.irq out turns that program off too.
#[test]
fn skipping_g_irq_in_kprobe_mode_turns_the_irq_tracepoint_off() {
    let f = k6_1();
    let mut p = plan(Mode::Kprobe, &f);
    assert!(p.programs().contains("irq_entry"));
    p.skip_points(&[Point::Irq]);
    assert!(!p.programs().contains("irq_entry"));
    assert!(!p.programs().contains("kp_vring_interrupt"));
    assert!(p.programs().contains("kp_complete_request"));
    let r = report(&p, &f, &all_live(&p), &BTreeMap::new());
    assert_eq!(r.blind_points, [Point::Irq]);
}

/// The programs that make a request's state attach after every other one, the
/// insert's last; the typed twins with their raw programs.
#[test]
fn request_tracking_programs_attach_last_the_insert_at_the_very_end() {
    for p in [
        "fx_update_request",
        "fe_complete_request",
        "fx_kick_prepare",
        "fe_add_sgs",
    ] {
        assert_eq!(attach_round(p), 0, "{p}");
    }
    assert!(attach_round("fe_queue_rq") < attach_round("rq_issue"));
    assert!(attach_round("rq_issue") < attach_round("rq_insert"));
    for TypedTp { typed, raw, .. } in TYPED_TPS {
        assert_eq!(attach_round(typed), attach_round(raw), "{typed}");
    }
}
