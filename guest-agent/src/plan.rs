//! The attach plan and the blind-spot report.
//!
//! [`plan`] turns what the kernel offers ([`Facts`]) and an attach mode into the
//! optional programs to load (one flavour per kernel-function hook, the io_uring
//! tracepoint generation this kernel has) and the variants the BPF object takes
//! where kernels differ ([`Variants`], written to its read-only data). [`report`]
//! then says what the run cannot see, from what actually loaded and attached.
//! Both are pure: unit tests feed them the facts of real Debian kernels.

use std::collections::BTreeSet;

use viotrace_shared::record::Point;

use crate::kernel::Facts;
use crate::probe::{Hook, Mode, SysHook, HOOKS, SYSCALLS};

/// Program flavour of a kernel-function hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    Fentry,
    Kprobe,
}

/// What a hook runs as on this kernel, or why it cannot run.
#[derive(Clone, Debug)]
pub struct HookChoice {
    pub hook: &'static Hook,
    pub flavour: Option<Flavour>,
    /// Why it has no flavour, or why it is not the mode's own.
    pub why: Option<String>,
}

impl HookChoice {
    /// Programs of the chosen flavour.
    pub fn programs(&self) -> &'static [&'static str] {
        match self.flavour {
            Some(Flavour::Fentry) => self.hook.fentry,
            Some(Flavour::Kprobe) => self.hook.kprobe,
            None => &[],
        }
    }

    /// The kernel has no such function and the hook is an alternative path.
    fn path_absent(&self, f: &Facts) -> bool {
        self.hook.alt_path && !f.syms.contains_key(self.hook.target)
    }
}

/// Choices the BPF object makes where kernels differ (its .rodata).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Variants {
    /// The bio tracepoints carry the request_queue first (5.10).
    pub tp_bio_has_queue: bool,
    /// Position of the request in io_uring_submit_sqe's arguments.
    pub tp_uring_sqe_req_pos: u8,
    /// Read the descriptor head at the 5.0-6.x vring_virtqueue layout (no BTF for it).
    pub vvq_assume_layout: bool,
    /// Address of vring_interrupt for irq_handler_entry (0 = neither irq_entry
    /// nor tb_irq_entry runs).
    pub vring_interrupt_addr: u64,
    /// tb_irq_entry: the addresses of [`VDEV_IRQ_HANDLERS`] (0: not in this kernel).
    pub vdev_irq_handlers: [u64; 3],
}

/// The virtio interrupt handlers whose irqaction names the virtio device, not a
/// virtqueue: a vector shared by a device's queues and INTx (virtio-pci), and
/// virtio-mmio's.
pub const VDEV_IRQ_HANDLERS: [&str; 3] = ["vp_vring_interrupt", "vp_interrupt", "vm_interrupt"];

/// fentry mode's program for g.irq on irq_handler_entry, instead of
/// `fe_vring_interrupt`'s trampoline.
pub const TYPED_IRQ_PROG: &str = "tb_irq_entry";

/// A tracepoint whose program has a typed twin in fentry mode (tp_btf): the
/// tracepoint's bio or request is a typed pointer, read with plain loads where
/// the raw program makes probe reads (and, for bios, keeps a disk cache). The
/// raw one is always loaded, and attached only when the typed one is not.
#[derive(Clone, Copy, Debug)]
pub struct TypedTp {
    pub typed: &'static str,
    pub raw: &'static str,
    pub tracepoint: &'static str,
    /// The oldest kernel it is planned on: the request ones take the request's
    /// address as a number with bpf_get_current_task_btf (5.11+).
    pub since: (u32, u32),
}

pub const TYPED_TPS: [TypedTp; 3] = [
    TypedTp {
        typed: "tb_bio_queue",
        raw: "bio_queue",
        tracepoint: "block_bio_queue",
        since: (0, 0),
    },
    TypedTp {
        typed: "tb_rq_insert",
        raw: "rq_insert",
        tracepoint: "block_rq_insert",
        since: (5, 11),
    },
    TypedTp {
        typed: "tb_rq_issue",
        raw: "rq_issue",
        tracepoint: "block_rq_issue",
        since: (5, 11),
    },
];

/// When `prog` is attached, in rounds 0 to 3 (each round in the object's order).
/// The programs that make a request's state come last, those of its earliest point
/// (the insert) at the very end: a request tracked while the others were still
/// being attached would miss their points (its kick, its driver completion) and
/// count as a loss; tracked after, it has them all. A request in flight before
/// is tracked at a later point (its issue, its batch) or not at all.
pub fn attach_round(prog: &str) -> u8 {
    match prog {
        "rq_insert" | "tb_rq_insert" => 3,
        "rq_issue" | "tb_rq_issue" => 2,
        "fe_queue_rq" | "fe_queue_rqs" | "kp_queue_rq" | "kp_queue_rqs" => 1,
        _ => 0,
    }
}

/// Whether `prog` is the typed twin of a raw tracepoint's program.
pub fn is_typed_tp(prog: &str) -> bool {
    TYPED_TPS.iter().any(|t| t.typed == prog)
}

/// The file of read, write, pread64 and pwrite64 taken typed where the syscall
/// reaches `vfs_read` / `vfs_write` (fentry mode): the syscall's entry then
/// skips its walk of the fd table (three probe reads). Optional: without both,
/// the entry resolves the fd as in the other modes.
pub const TYPED_FILE_PROGS: [&str; 2] = ["fe_vfs_read", "fe_vfs_write"];
/// Their kernel functions.
pub const TYPED_FILE_TARGETS: [&str; 2] = ["vfs_read", "vfs_write"];

/// Programs that may be left out without failing the run.
pub const OPTIONAL_TP_PROGS: &[&str] = &[
    "uring_submit",
    "uring_submit_sqe",
    "tb_uring_submit",
    "tb_uring_submit_sqe",
    "irq_entry",
    TYPED_IRQ_PROG,
    "off_cpu_switch",
    "off_cpu_wakeup",
];

/// The off-CPU accounting of traced syscalls (for the verdicts, `-t`).
pub const OFF_CPU_PROGS: [&str; 2] = ["off_cpu_switch", "off_cpu_wakeup"];

/// The io_uring submit programs' typed twins (tp_btf; fentry mode, 6.0+, where the
/// tracepoint's request comes first): (typed, raw). A refused typed one gives way
/// to its raw twin.
pub const URING_TYPED: [(&str, &str); 2] = [
    ("tb_uring_submit", "uring_submit"),
    ("tb_uring_submit_sqe", "uring_submit_sqe"),
];

/// What io_uring requests' files and offsets come from.
const URING_SEES: &str = "file and offset of io_uring requests";
/// What an unreadable descriptor head loses.
const HEAD_SEES: &str = "descriptor head of each request (the join key with the host)";

/// Whether `prog` may fail without failing the run.
pub fn is_optional(prog: &str) -> bool {
    OPTIONAL_TP_PROGS.contains(&prog)
        || is_typed_tp(prog)
        || TYPED_FILE_PROGS.contains(&prog)
        || HOOKS
            .iter()
            .any(|h| h.fentry.contains(&prog) || h.kprobe.contains(&prog))
        || is_sys_fentry(prog)
}

/// Whether `prog` is one of the per-syscall fentry/fexit programs.
pub fn is_sys_fentry(prog: &str) -> bool {
    SYSCALLS.iter().any(|s| s.enter == prog || s.exit == prog)
}

/// What to load on this kernel in one mode.
#[derive(Clone, Debug)]
pub struct Plan {
    pub hooks: Vec<HookChoice>,
    /// The io_uring submit program this kernel can run, or why none.
    pub uring: Result<&'static str, String>,
    pub variants: Variants,
    /// Fallbacks taken and assumptions made (not blind spots).
    pub notes: Vec<String>,
    /// Details known to be missing before anything is loaded.
    pub blind: Vec<String>,
    /// Load the off-CPU accounting (the agent sets it for `-t`).
    pub off_cpu: bool,
    /// Also trap `virtqueue_notify` for the exact time of each notification
    /// (`--exact-kick`); otherwise `g.kick` is when `virtqueue_kick_prepare`
    /// returned, just before the driver notifies.
    pub exact_kick: bool,
    /// The syscalls traced by fentry/fexit programs on their wrappers (fentry
    /// mode); empty: the raw `sys_enter`/`sys_exit` tracepoints trace them.
    pub sys_fentry: Vec<&'static SysHook>,
    /// The typed programs of [`TYPED_TPS`] that run instead of their raw twins.
    pub typed_tps: BTreeSet<&'static str>,
    /// Reads' and writes' files come from `TYPED_FILE_PROGS`.
    pub typed_file: bool,
    /// g.irq comes from [`TYPED_IRQ_PROG`] instead of `fe_vring_interrupt`.
    pub typed_irq: bool,
}

impl Plan {
    /// Optional programs to load.
    pub fn programs(&self) -> BTreeSet<&'static str> {
        let mut p: BTreeSet<&'static str> = self
            .hooks
            .iter()
            .filter(|c| self.exact_kick || c.hook.target != EXACT_KICK_TARGET)
            .flat_map(|c| c.programs().iter().copied())
            .collect();
        if let Ok(u) = self.uring {
            p.insert(u);
        }
        if self.typed_irq {
            p.remove("fe_vring_interrupt");
            p.insert(TYPED_IRQ_PROG);
        } else if self.variants.vring_interrupt_addr != 0 {
            p.insert("irq_entry");
        }
        if self.off_cpu {
            p.extend(OFF_CPU_PROGS);
        }
        p.extend(self.sys_fentry.iter().flat_map(|s| [s.enter, s.exit]));
        p.extend(self.typed_tps.iter().copied());
        if self.typed_file {
            p.extend(TYPED_FILE_PROGS);
        }
        p
    }

    /// The typed file programs cannot both run: the syscalls' entries resolve
    /// the fd (one of them alone would see nothing: the entries leave the file
    /// to them only when both are in).
    pub fn file_fallback(&mut self, why: &str) {
        if self.typed_file {
            self.typed_file = false;
            self.notes.push(format!(
                "read/write files: {why}: resolved from the fd at the syscall's entry"
            ));
        }
    }

    /// Typed program `prog` cannot run: its raw twin does the same.
    pub fn typed_fallback(&mut self, prog: &str, why: &str) {
        if let Some(t) = TYPED_TPS.iter().find(|t| t.typed == prog) {
            if self.typed_tps.remove(t.typed) {
                self.notes.push(format!(
                    "{}: {why}: the raw tracepoint's program {} instead",
                    t.tracepoint, t.raw
                ));
            }
        }
    }

    /// [`TYPED_IRQ_PROG`] cannot run: `fe_vring_interrupt` takes g.irq.
    pub fn irq_fallback(&mut self, why: &str) {
        if self.typed_irq {
            self.typed_irq = false;
            self.variants.vring_interrupt_addr = 0;
            self.variants.vdev_irq_handlers = [0; 3];
            self.notes.push(format!(
                "g.irq: {why}: a trampoline on vring_interrupt instead"
            ));
        }
    }

    /// The per-syscall programs cannot all run: every syscall goes back to the
    /// raw tracepoints (a mix would trace some syscalls twice, or none).
    pub fn sys_fallback(&mut self, why: &str) {
        if !self.sys_fentry.is_empty() {
            self.sys_fentry.clear();
            // (plan_syscalls's note on the wrappers no longer holds)
            self.notes.retain(|n| !n.starts_with(SYS_FENTRY_NOTE));
            self.notes.push(format!(
                "syscalls: {why}: the raw sys_enter/sys_exit tracepoints instead"
            ));
        }
    }

    /// Takes `prog` out of the plan after the kernel refused it: the hook or
    /// tracepoint it serves goes blind, the rest stays.
    pub fn drop_program(&mut self, prog: &str) {
        let why = format!("program {prog} refused by this kernel");
        for c in &mut self.hooks {
            if c.programs().contains(&prog) {
                c.flavour = None;
                c.why = Some(why.clone());
            }
        }
        if matches!(self.uring, Ok(u) if u == prog) {
            self.uring = match URING_TYPED.iter().find(|(t, _)| *t == prog) {
                Some((_, raw)) => {
                    self.notes.push(format!(
                        "io_uring requests: {why}: the raw tracepoint's program {raw} instead"
                    ));
                    Ok(raw)
                }
                None => Err(why.clone()),
            };
        }
        if prog == "irq_entry" {
            self.variants.vring_interrupt_addr = 0;
        }
        if prog == TYPED_IRQ_PROG {
            self.irq_fallback(&why);
        }
        if OFF_CPU_PROGS.contains(&prog) {
            self.off_cpu = false;
            self.blind.push(format!("off-CPU time of syscalls ({why})"));
        }
        if is_sys_fentry(prog) {
            self.sys_fallback(&why);
        }
        if is_typed_tp(prog) {
            self.typed_fallback(prog, &why);
        }
        if TYPED_FILE_PROGS.contains(&prog) {
            self.file_fallback(&why);
        }
    }

    /// The choice for hook `target`.
    pub fn choice(&self, target: &str) -> Option<&HookChoice> {
        self.hooks.iter().find(|c| c.hook.target == target)
    }

    /// Leaves out the programs of `points` (`--skip-points`, each one of
    /// [`SKIPPABLE`]): those points go blind, and the report says why.
    pub fn skip_points(&mut self, points: &[Point]) {
        for &p in points {
            let Some((_, targets)) = SKIPPABLE.iter().find(|(q, _)| *q == p) else {
                continue;
            };
            for c in &mut self.hooks {
                if targets.contains(&c.hook.target) {
                    c.flavour = None;
                    c.why = Some(format!("left out (--skip-points {p})"));
                }
            }
            if targets.contains(&"vring_interrupt") {
                self.variants.vring_interrupt_addr = 0;
                self.variants.vdev_irq_handlers = [0; 3];
                self.typed_irq = false;
            }
        }
    }
}

/// The points `--skip-points` may leave out, with the hooks that serve only
/// them. The others carry the join key (g.vq_add), make the record (g.rq_issue,
/// g.rq_complete) or attribute it: g.syscall_enter, g.bio_queue, g.syscall_exit,
/// and g.rq_insert, where a request takes the identity of its first bio from the
/// thread that queued it (issued later by a kworker, the request would find no
/// task). g.irq is taken when the driver completes the request: leaving out
/// g.driver_complete leaves it out too.
pub const SKIPPABLE: &[(Point, &[&str])] = &[
    (Point::QueueRq, &["virtio_queue_rq", "virtio_queue_rqs"]),
    (Point::Kick, &["virtqueue_kick_prepare", EXACT_KICK_TARGET]),
    (Point::Irq, &["vring_interrupt"]),
    (
        Point::DriverComplete,
        &["blk_mq_complete_request", "vring_interrupt"],
    ),
    (Point::BioComplete, &["blk_update_request"]),
];

/// `--skip-points lean`: the costliest of them (docs/PERFORMANCE.md); g.queue_rq
/// stays (it also tracks a request whose block_rq_issue run the kernel skipped).
pub const LEAN: &[Point] = &[
    Point::Kick,
    Point::Irq,
    Point::DriverComplete,
    Point::BioComplete,
];

/// Points to leave out, as `--skip-points` reads them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SkipPoints(pub Vec<Point>);

impl std::str::FromStr for SkipPoints {
    type Err = String;

    /// A comma-separated list of [`SKIPPABLE`] point names (`g.kick`, or
    /// `kick`), or `lean` ([`LEAN`]); repeated names count once.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut v: Vec<Point> = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let points: Vec<Point> = if name == "lean" {
                LEAN.to_vec()
            } else {
                let full = if name.contains('.') {
                    name.to_string()
                } else {
                    format!("g.{name}")
                };
                let p = Point::from_name(&full).ok_or_else(|| format!("no point {name:?}"))?;
                if !SKIPPABLE.iter().any(|(q, _)| *q == p) {
                    return Err(format!(
                        "{p} cannot be left out (it makes, joins or attributes the record); \
                         these can: {}, or lean",
                        SKIPPABLE
                            .iter()
                            .map(|(q, _)| q.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                vec![p]
            };
            for p in points {
                if !v.contains(&p) {
                    v.push(p);
                }
            }
        }
        if v.is_empty() {
            return Err("no point named".into());
        }
        Ok(SkipPoints(v))
    }
}

fn choose(mode: Mode, h: &'static Hook, f: &Facts) -> HookChoice {
    let no = |why: String| HookChoice {
        hook: h,
        flavour: None,
        why: Some(why),
    };
    let Some(module) = f.module_of(h.target) else {
        return no(if h.alt_path {
            format!("{} not in this kernel (no such path)", h.target)
        } else {
            format!(
                "{} not in /proc/kallsyms (module not loaded or function inlined)",
                h.target
            )
        });
    };
    let kprobe = |why: String| HookChoice {
        hook: h,
        flavour: Some(Flavour::Kprobe),
        why: Some(why),
    };
    match mode {
        Mode::Tracepoint | Mode::Auto => no(format!(
            "needs fentry or kprobes on {} ({mode} mode)",
            h.target
        )),
        Mode::Kprobe if f.kprobes => HookChoice {
            hook: h,
            flavour: Some(Flavour::Kprobe),
            why: None,
        },
        Mode::Kprobe => no("kprobes are not available on this kernel".into()),
        Mode::Fentry if f.fentry && f.has_btf(module) => HookChoice {
            hook: h,
            flavour: Some(Flavour::Fentry),
            why: None,
        },
        Mode::Fentry => {
            let why = if f.fentry {
                format!("no BTF for {module} (/sys/kernel/btf/{module}), which fentry needs")
            } else {
                "fentry programs do not load on this kernel".into()
            };
            if f.kprobes {
                kprobe(format!("{why}: kprobe instead"))
            } else {
                no(format!("{why}, and kprobes are not available"))
            }
        }
    }
}

/// How the note on per-syscall fentry programs begins.
const SYS_FENTRY_NOTE: &str = "syscalls: fentry/fexit on";

/// The syscalls fentry mode traces on their wrappers, and a note on the choice.
/// A wrapper missing from kallsyms is a syscall this kernel does not have (no
/// io_uring or aio built in): nothing to trace. No wrapper at all (another
/// naming, or no vmlinux BTF): the raw tracepoints.
fn plan_syscalls(mode: Mode, f: &Facts) -> (Vec<&'static SysHook>, Option<String>) {
    if mode != Mode::Fentry {
        return (Vec::new(), None);
    }
    if !f.fentry || !f.has_btf("vmlinux") {
        let why = "syscalls: the raw sys_enter/sys_exit tracepoints (fentry on the syscall \
                   wrappers needs vmlinux BTF)";
        return (Vec::new(), Some(why.into()));
    }
    let (present, absent): (Vec<&SysHook>, Vec<&SysHook>) = SYSCALLS
        .iter()
        .partition(|s| f.module_of(s.target) == Some("vmlinux"));
    if present.is_empty() {
        let why = "syscalls: no __x64_sys_* wrapper in /proc/kallsyms: the raw sys_enter/sys_exit \
                   tracepoints";
        return (Vec::new(), Some(why.into()));
    }
    // (One refused program would have the whole object loaded again, about a
    // second under emulation, to end in the same fallback.)
    if let Some(s) = present
        .iter()
        .find(|s| f.sys_untyped_regs.contains(s.target))
    {
        let why = format!(
            "syscalls: {}'s struct pt_regs argument is untyped in this kernel's BTF (fentry on \
             it is refused): the raw sys_enter/sys_exit tracepoints",
            s.target
        );
        return (Vec::new(), Some(why));
    }
    let mut note = format!(
        "{SYS_FENTRY_NOTE} {} syscall wrappers (no program runs on other syscalls)",
        present.len()
    );
    if !absent.is_empty() {
        let names: Vec<&str> = absent.iter().map(|s| s.target).collect();
        note += &format!("; not in this kernel: {}", names.join(", "));
    }
    (present, Some(note))
}

/// Position of the request in io_uring_submit_sqe's arguments, if it has one.
fn uring_sqe_req_pos(args: &[Option<String>]) -> Option<u8> {
    match args {
        // 5.19-6.1: (struct io_kiocb *req, bool force_nonblock)
        [Some(r), _] if r == "io_kiocb" => Some(0),
        // 5.10 (Debian's backport), 5.15: (void *ctx, void *req, opcode, user_data, flags,
        // force_nonblock, sq_thread)
        [_, _, _, _, _, _, _] => Some(1),
        // 5.11-5.14: (ctx, opcode, user_data, force_nonblock, sq_thread): no request
        _ => None,
    }
}

/// The plan for `mode` (not `Auto`: the caller tries the modes in turn).
pub fn plan(mode: Mode, f: &Facts) -> Plan {
    let hooks: Vec<HookChoice> = HOOKS.iter().map(|h| choose(mode, h, f)).collect();
    let mut notes = Vec::new();
    let mut blind = Vec::new();
    let mut variants = Variants {
        tp_bio_has_queue: f.tracepoints.get("block_bio_queue").is_some_and(|a| {
            a.first()
                .is_some_and(|q| q.as_deref() == Some("request_queue"))
        }),
        ..Variants::default()
    };
    let uring = if f.tracepoints.contains_key("io_uring_submit_req") {
        Ok("uring_submit")
    } else if let Some(args) = f.tracepoints.get("io_uring_submit_sqe") {
        match uring_sqe_req_pos(args) {
            Some(pos) => {
                variants.tp_uring_sqe_req_pos = pos;
                Ok("uring_submit_sqe")
            }
            None => Err(format!(
                "io_uring_submit_sqe has no request argument on this kernel ({} arguments)",
                args.len()
            )),
        }
    } else {
        Err("no io_uring submit tracepoint (io_uring not built in?)".to_string())
    };
    for c in &hooks {
        if let (Some(_), Some(why)) = (c.flavour, &c.why) {
            notes.push(format!("{}: {why}", c.hook.target));
        }
    }
    let add_sgs = hooks.iter().find(|c| c.hook.target == "virtqueue_add_sgs");
    if let Some(module) = add_sgs
        .filter(|c| c.flavour.is_some())
        .and_then(|c| f.module_of(c.hook.target))
    {
        if !f.has_btf(module) {
            // Same offset from 5.0 to 6.x (6 or 8 bools after the embedded virtqueue).
            if (5, 0) <= f.version() && f.version() < (7, 0) {
                variants.vvq_assume_layout = true;
                notes.push(format!(
                    "descriptor head: no BTF for vring_virtqueue ({module}); read at the \
                     offset every 5.0-6.x kernel has"
                ));
            } else {
                blind.push(format!(
                    "{HEAD_SEES}: no BTF for vring_virtqueue ({module}) and no known layout \
                     for kernel {}",
                    f.release
                ));
            }
        }
    }
    if let Some(vi) = hooks.iter().find(|c| c.hook.target == "vring_interrupt") {
        // A kprobe nested in another BPF kprobe is skipped; the irq tracepoint is not.
        if vi.flavour == Some(Flavour::Kprobe) {
            variants.vring_interrupt_addr = f.syms.get("vring_interrupt").map_or(0, |s| s.addr);
        }
    }
    let (sys_fentry, sys_note) = plan_syscalls(mode, f);
    notes.extend(sys_note);
    // tp_btf programs need what fentry ones need: tracing programs and vmlinux BTF.
    let typed = mode == Mode::Fentry && f.fentry && f.has_btf("vmlinux");
    let typed_irq = typed && plan_typed_irq(&hooks, f, &mut variants);
    let typed_tps = TYPED_TPS
        .iter()
        .filter(|t| typed && f.version() >= t.since)
        .map(|t| t.typed)
        .collect();
    // (the raw uring_submit_sqe's request position 0: 5.19-6.1; 1 on 5.10 and 5.15)
    let uring = match uring {
        Ok(raw) if typed && f.version() >= (6, 0) && variants.tp_uring_sqe_req_pos == 0 => {
            Ok(URING_TYPED
                .iter()
                .find(|(_, r)| *r == raw)
                .map_or(raw, |(t, _)| *t))
        }
        u => u,
    };
    let typed_file = typed
        && TYPED_FILE_TARGETS
            .iter()
            .all(|t| f.module_of(t) == Some("vmlinux"));
    Plan {
        hooks,
        uring,
        variants,
        notes,
        blind,
        off_cpu: false,
        exact_kick: false,
        sys_fentry,
        typed_tps,
        typed_file,
        typed_irq,
    }
}

/// Where tp_btf programs run, g.irq comes from irq_handler_entry (typed) if
/// vring_interrupt's hook is a trampoline and this kernel names vring_interrupt
/// and virtio-pci's two other handlers (a shared vector, INTx) in
/// /proc/kallsyms; else from that trampoline. Sets the handlers' addresses in
/// `variants` when it does.
fn plan_typed_irq(hooks: &[HookChoice], f: &Facts, variants: &mut Variants) -> bool {
    let addr = |name: &str| f.syms.get(name).map_or(0, |s| s.addr);
    let fentry = hooks
        .iter()
        .any(|c| c.hook.target == "vring_interrupt" && c.flavour == Some(Flavour::Fentry));
    // (vm_interrupt only where virtio_mmio is loaded)
    let named = addr("vring_interrupt") != 0 && VDEV_IRQ_HANDLERS[..2].iter().all(|h| addr(h) != 0);
    if !fentry || !named {
        return false;
    }
    variants.vring_interrupt_addr = addr("vring_interrupt");
    variants.vdev_irq_handlers = VDEV_IRQ_HANDLERS.map(addr);
    true
}

/// The hook only `--exact-kick` attaches: the kick point has a cheaper source.
pub const EXACT_KICK_TARGET: &str = "virtqueue_notify";

/// Whether `prog` is a kprobe or kretprobe program.
pub fn is_kprobe(prog: &str) -> bool {
    HOOKS.iter().any(|h| h.kprobe.contains(&prog))
}

#[path = "plan_report.rs"]
mod report;
pub use report::{report, Report};

#[cfg(test)]
#[path = "plan_fixtures.rs"]
mod fixtures;
#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
