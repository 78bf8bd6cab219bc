//! Opening, configuring, loading and attaching the BPF object in one mode.
//!
//! Optional programs (hook flavours, io_uring generations, the irq tracepoint)
//! are enabled as the [`Plan`] says. If the kernel still refuses one of them at
//! load (the verifier has the last word), or libbpf cannot apply one of its
//! CO-RE relocations to this kernel's types (which fails the whole object's
//! load), that program is left out and the object is loaded again: an
//! optional program never takes the others down.
//! What finally runs decides the [`Report`].

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::mem::{offset_of, size_of, MaybeUninit};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use libbpf_rs::libbpf_sys::bpf_prog_info;
use libbpf_rs::query::{LinkTypeInfo, PerfEventType};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::Link;

use crate::bpf::{OpenViotraceGuestSkel, ViotraceGuestSkel, ViotraceGuestSkelBuilder};
use crate::kernel::Facts;
use crate::plan::{self, Plan, Report, Variants};
use crate::probe::{Mode, SYS_TP_PROGS};
use crate::Filters;
use viotrace_shared::selfcost::BpfRuns;

/// A loaded and attached object.
pub struct Running {
    pub skel: ViotraceGuestSkel<'static>,
    /// Attached programs by name.
    links: Vec<(String, Link)>,
    pub mode: Mode,
    pub report: Report,
    /// The off-CPU accounting of syscalls is attached.
    pub off_cpu: bool,
    /// Where the start-up time went.
    pub startup: Startup,
}

/// The start-up's phases: loading (open, CO-RE relocation against the kernel's BTF,
/// the verifier, over every attempt) and attaching.
#[derive(Debug, Clone, Copy, Default)]
pub struct Startup {
    pub load: std::time::Duration,
    /// Load attempts (one more per optional program set the kernel refused).
    pub attempts: u32,
    pub attach: std::time::Duration,
    /// The verifier's processed instructions (Linux 5.16+).
    pub verified_insns: Option<u64>,
}

impl Running {
    /// Hits the kernel skipped on this run's kprobes (a kprobe that fires while another
    /// BPF kprobe program runs on the CPU is not run): 0 without kprobes; None when the
    /// kernel cannot tell (perf-event link info has the count since Linux 6.7).
    pub fn kprobe_missed(&self) -> Option<u64> {
        let mut sum = 0;
        for (name, link) in &self.links {
            if !plan::is_kprobe(name) {
                continue;
            }
            match link.info().ok().map(|i| i.info) {
                Some(LinkTypeInfo::PerfEvent(p)) => match p.event_type {
                    PerfEventType::Kprobe { missed, .. } => sum += missed,
                    _ => return None,
                },
                _ => return None,
            }
        }
        Some(sum)
    }

    /// Runs of this object's attached programs the kernel skipped because the program
    /// was already running on the CPU (`recursion_misses`, Linux 5.12+; None before).
    pub fn bpf_runs_missed(&self) -> Option<u64> {
        self.bpf_runs_missed_by_program()
            .map(|v| v.iter().map(|(_, n)| n).sum())
    }

    /// The same per attached program.
    pub fn bpf_runs_missed_by_program(&self) -> Option<Vec<(String, u64)>> {
        let mut out = Some(Vec::new());
        self.each_attached(|name, fd| {
            let missed = prog_info(fd).and_then(|i| {
                i.has(offset_of!(bpf_prog_info, recursion_misses) + size_of::<u64>())
                    .then_some(i.info.recursion_misses)
            });
            match (&mut out, missed) {
                (Some(v), Some(n)) => v.push((name, n)),
                _ => out = None,
            }
        });
        out
    }

    /// The kernel's run time and run count of the attached programs, summed (both 0
    /// while the kernel does not measure them: `kernel.bpf_stats_enabled`).
    pub fn bpf_runs(&self) -> BpfRuns {
        let mut sum = BpfRuns::default();
        self.each_attached(|_, fd| {
            if let Some(i) = prog_info(fd) {
                sum.ns += i.info.run_time_ns;
                sum.runs += i.info.run_cnt;
            }
        });
        sum
    }

    /// Calls `f` with the name and descriptor of each attached program.
    fn each_attached(&self, mut f: impl FnMut(String, BorrowedFd<'_>)) {
        for p in self.skel.object().progs() {
            let name = p.name().to_string_lossy().into_owned();
            if self.links.iter().any(|(n, _)| *n == name) {
                f(name, p.as_fd());
            }
        }
    }
}

/// A loaded program's info and how much of it this kernel filled in.
struct ProgInfo {
    info: bpf_prog_info,
    len: u32,
}

impl ProgInfo {
    /// The kernel filled the info up to byte `end` (a field's offset + size).
    fn has(&self, end: usize) -> bool {
        self.len as usize >= end
    }
}

/// A loaded program's info, when it has run time and runs (Linux 5.1+).
fn prog_info(fd: BorrowedFd<'_>) -> Option<ProgInfo> {
    let mut info = bpf_prog_info::default();
    let mut len = size_of::<bpf_prog_info>() as u32;
    // SAFETY: `info` is a writable bpf_prog_info of `len` bytes, its pointer fields are
    // zero (nothing is requested), and the kernel writes at most `len` bytes.
    let r = unsafe {
        libbpf_rs::libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len)
    };
    let i = ProgInfo { info, len };
    (r == 0 && i.has(offset_of!(bpf_prog_info, run_cnt) + size_of::<u64>())).then_some(i)
}

/// Instructions the verifier processed for the loaded programs of `skel`, summed
/// (Linux 5.16+; None before): the start-up's main cost, and what grows when a
/// program's paths multiply.
fn verified_insns(skel: &ViotraceGuestSkel<'_>) -> Option<u64> {
    let mut sum = 0u64;
    for p in skel.object().progs() {
        if !p.autoload() {
            continue;
        }
        let i = prog_info(p.as_fd())?;
        if !i.has(offset_of!(bpf_prog_info, verified_insns) + size_of::<u32>()) {
            return None;
        }
        sum += u64::from(i.info.verified_insns);
    }
    Some(sum)
}

/// Programs libbpf reported as failing to load during the current attempt.
static LOAD_FAILED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// `--libbpf-log`: libbpf's debug messages go to stderr too.
pub static LIBBPF_DEBUG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// libbpf's messages go to stderr, except the expected failure of an optional
/// tracepoint (reported once, in our words); load failures are also noted.
pub fn libbpf_print(level: libbpf_rs::PrintLevel, msg: String) {
    if level == libbpf_rs::PrintLevel::Debug {
        if LIBBPF_DEBUG.load(std::sync::atomic::Ordering::Relaxed) {
            eprint!("{msg}");
        }
        return;
    }
    if let Some(name) = failed_program(&msg) {
        LOAD_FAILED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(name.to_string());
    }
    let optional_tp = plan::OPTIONAL_TP_PROGS
        .iter()
        .any(|p| msg.contains(&format!("prog '{p}': failed to attach")));
    if !optional_tp {
        eprint!("{msg}");
    }
}

/// The program a libbpf warning says failed: its load (the verifier refused
/// it) or one of its CO-RE relocations (a field or type this kernel lacks in
/// a form libbpf cannot poison, a load of another size than the field's),
/// which fails the whole object's load before any program is loaded.
fn failed_program(msg: &str) -> Option<&str> {
    let (name, tail) = msg.strip_prefix("libbpf: prog '")?.split_once('\'')?;
    let relo = tail.starts_with(": relo #") && tail.contains(": failed to ");
    (tail.starts_with(": failed to load") || relo).then_some(name)
}

fn set_config(open: &mut OpenViotraceGuestSkel<'_>, f: &Filters, p: &Plan) -> Result<()> {
    let enabled = p.programs();
    let ro = open
        .maps
        .rodata_data
        .as_deref_mut()
        .context("BPF object has no .rodata")?;
    ro.self_pid = std::process::id();
    ro.filter_pid = f.pid;
    ro.filter_tid = f.tid;
    if let Some(c) = f.comm {
        ro.filter_comm_on = 1;
        for (d, s) in ro.filter_comm.iter_mut().zip(c) {
            *d = s as i8;
        }
    }
    ro.filter_cgroup = f.cgroup;
    ro.io_detail_ns = f.io_detail_ns;
    if let Some((maj, min)) = f.disk {
        ro.filter_disk_on = 1;
        ro.filter_disk_major = maj;
        ro.filter_disk_minor = min;
    }
    let has = |p: &str| enabled.contains(p);
    ro.emit_at_rq_complete = u8::from(!has("fx_update_request") && !has("kp_update_request"));
    ro.have_driver_complete = u8::from(has("fe_complete_request") || has("kp_complete_request"));
    ro.have_kick = u8::from(has("fx_kick_prepare") || has("kp_kick_prepare"));
    ro.have_notify = u8::from(has("fe_notify") || has("kp_notify"));
    let Variants {
        tp_bio_has_queue,
        tp_uring_sqe_req_pos,
        vvq_assume_layout,
        vring_interrupt_addr,
        vdev_irq_handlers,
    } = p.variants;
    ro.tp_bio_has_queue = u8::from(tp_bio_has_queue);
    ro.tp_uring_sqe_req_pos = tp_uring_sqe_req_pos;
    ro.vvq_assume_layout = u8::from(vvq_assume_layout);
    let typed_irq = enabled.contains(plan::TYPED_IRQ_PROG);
    ro.vring_interrupt_addr = if enabled.contains("irq_entry") || typed_irq {
        vring_interrupt_addr
    } else {
        0
    };
    ro.vdev_irq_handlers = if typed_irq { vdev_irq_handlers } else { [0; 3] };
    Ok(())
}

/// One load attempt with the optional programs in `plan.programs()`.
fn load(plan: &Plan, f: &Filters) -> Result<ViotraceGuestSkel<'static>> {
    // One object per attempt; a failed attempt's storage is not reused (rare, small).
    let storage: &'static mut MaybeUninit<libbpf_rs::OpenObject> =
        Box::leak(Box::new(MaybeUninit::uninit()));
    let mut open = ViotraceGuestSkelBuilder::default()
        .open(storage)
        .context("opening BPF object")?;
    set_config(&mut open, f, plan)?;
    let enabled = plan.programs();
    for mut p in open.open_object_mut().progs_mut() {
        let name = p.name().to_string_lossy().into_owned();
        if plan::is_optional(&name) {
            p.set_autoload(enabled.contains(name.as_str()));
        }
    }
    // libbpf holds its own copies now: the embedded object's pages go back
    // before the load, the agent's memory peak.
    if let Err(e) = crate::embedded::release_object_pages() {
        eprintln!("viotrace-guest: note: the embedded BPF object stays resident: {e}");
    }
    Ok(open.load()?)
}

/// Loads and attaches the object in `mode`, leaving out optional programs this
/// kernel refuses.
pub fn start(mode: Mode, facts: &Facts, f: &Filters) -> Result<Running> {
    let mut plan = plan::plan(mode, facts);
    plan.off_cpu = f.off_cpu;
    plan.exact_kick = f.exact_kick;
    plan.skip_points(&f.skip_points);
    if f.sys_tracepoints {
        plan.sys_fallback("--syscall-tracepoints");
    }
    let mut failed: BTreeMap<String, String> = BTreeMap::new();
    let mut startup = Startup::default();
    let t_load = std::time::Instant::now();
    let skel = load_leaving_out(&mut plan, mode, f, &mut startup, &mut failed)?;
    startup.load = t_load.elapsed();
    startup.verified_insns = verified_insns(&skel);
    let t_attach = std::time::Instant::now();
    let mut att = attach_planned(&skel, &plan, mode, &mut failed)?;
    fall_back(&skel, &mut plan, mode, &mut att)?;
    startup.attach = t_attach.elapsed();
    let Attached { links, live } = att;
    let report = plan::report(&plan, facts, &live, &failed);
    let mut skel = skel;
    // io_submit's entry program leaves the iocbs to aio_prep_rw's once that is
    // attached, and read/write entries their files to vfs_read's and vfs_write's.
    if let Some(bss) = skel.maps.bss_data.as_deref_mut() {
        bss.aio_iocb_hooked =
            u8::from(live.contains("fe_aio_prep_rw") || live.contains("kp_aio_prep_rw"));
        bss.rw_file_hooked = u8::from(plan.typed_file);
    } else {
        bail!("BPF object has no .bss");
    }
    let off_cpu = plan::OFF_CPU_PROGS.iter().all(|p| live.contains(*p));
    Ok(Running {
        skel,
        links,
        mode,
        report,
        off_cpu,
        startup,
    })
}

/// Loads the planned object, again without each optional program the kernel
/// refused (named in `failed`) until it loads; a refused program that is not
/// optional fails the start.
fn load_leaving_out(
    plan: &mut Plan,
    mode: Mode,
    f: &Filters,
    startup: &mut Startup,
    failed: &mut BTreeMap<String, String>,
) -> Result<ViotraceGuestSkel<'static>> {
    loop {
        startup.attempts += 1;
        LOAD_FAILED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        let e = match load(plan, f) {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        let names: BTreeSet<String> =
            std::mem::take(&mut *LOAD_FAILED.lock().unwrap_or_else(|p| p.into_inner()))
                .into_iter()
                .collect();
        let enabled = plan.programs();
        let optional: Vec<&'static str> = enabled
            .iter()
            .copied()
            .filter(|p| names.contains(*p))
            .collect();
        if optional.is_empty() || names.len() != optional.len() {
            return Err(e).with_context(|| format!("loading BPF object ({mode} mode)"));
        }
        for p in optional {
            eprintln!(
                "viotrace-guest: leaving out program {p}: it does not load on this \
                 kernel (libbpf's message above)"
            );
            failed.insert(p.to_string(), format!("load failed: {e}"));
            plan.drop_program(p);
        }
    }
}

/// The attached programs: their links, and their names.
struct Attached {
    links: Vec<(String, Link)>,
    live: HashSet<String>,
}

impl Attached {
    fn attach(&mut self, p: &libbpf_rs::ProgramMut<'_>, name: &str) -> libbpf_rs::Result<()> {
        let l = p.attach()?;
        self.links.push((name.to_string(), l));
        self.live.insert(name.to_string());
        Ok(())
    }
}

/// Attaches the planned programs, in their rounds; an optional one that does
/// not attach is noted in `failed`, any other fails the start. The raw syscall
/// tracepoints and the raw twins of typed ones wait for [`fall_back`].
fn attach_planned(
    skel: &ViotraceGuestSkel<'static>,
    plan: &Plan,
    mode: Mode,
    failed: &mut BTreeMap<String, String>,
) -> Result<Attached> {
    let mut att = Attached {
        links: Vec::new(),
        live: HashSet::new(),
    };
    for (round, p) in (0..4).flat_map(|r| skel.object().progs_mut().map(move |p| (r, p))) {
        let name = p.name().to_string_lossy().into_owned();
        if plan::attach_round(&name) != round {
            continue;
        }
        let optional = plan::is_optional(&name);
        if optional && !plan.programs().contains(name.as_str()) {
            continue;
        }
        // The raw syscall tracepoints wait until the per-syscall programs are in,
        // a raw block tracepoint's program until its typed twin is.
        let twin_planned = plan::TYPED_TPS
            .iter()
            .any(|t| t.raw == name && plan.typed_tps.contains(t.typed));
        if (SYS_TP_PROGS.contains(&name.as_str()) && !plan.sys_fentry.is_empty()) || twin_planned {
            continue;
        }
        match att.attach(&p, &name) {
            Ok(()) => {}
            Err(e) if optional => {
                failed.insert(name, format!("attach failed: {e}"));
            }
            Err(e) => return Err(e).with_context(|| format!("attaching {name} ({mode} mode)")),
        }
    }
    Ok(att)
}

/// Where planned programs did not attach, their fallbacks: the raw syscall
/// tracepoints for the per-syscall programs, a typed tracepoint's raw twin,
/// and the entries' own file lookup when vfs_read's and vfs_write's programs
/// are not both in.
fn fall_back(
    skel: &ViotraceGuestSkel<'static>,
    plan: &mut Plan,
    mode: Mode,
    att: &mut Attached,
) -> Result<()> {
    if !plan.sys_fentry.is_empty() {
        let missing = plan
            .programs()
            .into_iter()
            .find(|p| plan::is_sys_fentry(p) && !att.live.contains(*p));
        if let Some(p) = missing {
            let why = format!("program {p} did not attach");
            att.links.retain(|(n, _)| !plan::is_sys_fentry(n));
            att.live.retain(|n| !plan::is_sys_fentry(n));
            plan.sys_fallback(&why);
            for p in skel.object().progs_mut() {
                let name = p.name().to_string_lossy().into_owned();
                if SYS_TP_PROGS.contains(&name.as_str()) {
                    att.attach(&p, &name)
                        .with_context(|| format!("attaching {name} ({mode} mode)"))?;
                }
            }
        }
    }
    for plan::TypedTp { typed, raw, .. } in plan::TYPED_TPS {
        if !plan.typed_tps.contains(typed) || att.live.contains(typed) {
            continue;
        }
        plan.typed_fallback(typed, &format!("program {typed} did not attach"));
        for p in skel.object().progs_mut() {
            if p.name().to_string_lossy() == raw {
                att.attach(&p, raw)
                    .with_context(|| format!("attaching {raw} ({mode} mode)"))?;
            }
        }
    }
    if plan.typed_file && !plan::TYPED_FILE_PROGS.iter().all(|p| att.live.contains(*p)) {
        // (one alone would run for nothing: the entries wait for both)
        plan.file_fallback("vfs_read's and vfs_write's programs did not both attach");
        att.links
            .retain(|(n, _)| !plan::TYPED_FILE_PROGS.contains(&n.as_str()));
        att.live
            .retain(|n| !plan::TYPED_FILE_PROGS.contains(&n.as_str()));
    }
    Ok(())
}

/// The modes to try, best first.
pub fn candidate_modes(m: Mode, facts: &Facts) -> Vec<Mode> {
    match m {
        Mode::Auto => {
            let mut v = Vec::new();
            if facts.fentry {
                v.push(Mode::Fentry);
            }
            if facts.kprobes {
                v.push(Mode::Kprobe);
            }
            v.push(Mode::Tracepoint);
            v
        }
        m => vec![m],
    }
}

/// Starts the first mode of `modes` that works.
pub fn start_any(modes: &[Mode], facts: &Facts, f: &Filters) -> Result<Running> {
    let mut errors = Vec::new();
    for &m in modes {
        let t0 = std::time::Instant::now();
        match start(m, facts, f) {
            Ok(r) => {
                let s = r.startup;
                let insns = s
                    .verified_insns
                    .map(|n| format!(", verifier: {n} instructions"))
                    .unwrap_or_default();
                eprintln!(
                    "viotrace-guest: {m} mode on Linux {}, attached in {:.2}s \
                     (load {:.2}s in {} attempt(s){insns}; {} links attached in {:.2}s)",
                    facts.release,
                    t0.elapsed().as_secs_f64(),
                    s.load.as_secs_f64(),
                    s.attempts,
                    r.links.len(),
                    s.attach.as_secs_f64()
                );
                return Ok(r);
            }
            Err(e) => {
                eprintln!("viotrace-guest: {m} mode unavailable: {e:#}");
                errors.push(format!("{m}: {e:#}"));
            }
        }
    }
    bail!("no attach mode works: {}", errors.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::HOOKS;

    /// libbpf 1.7's warnings (libbpf.c, relo_core.c), as its print callback
    /// gets them: those that name a failed program, and those that do not.
    #[test]
    fn failed_programs_are_named_from_libbpf_warnings() {
        let named = [
            (
                "libbpf: prog 'fe_vfs_read': failed to load: -13\n",
                "fe_vfs_read",
            ),
            (
                "libbpf: prog 'tb_uring_submit': relo #4: failed to relocate: -EINVAL\n",
                "tb_uring_submit",
            ),
            (
                "libbpf: prog 'tb_uring_submit': relo #4: failed to patch insn #12: -EINVAL\n",
                "tb_uring_submit",
            ),
            (
                "libbpf: prog 'x': relo #0: failed to record relocation: -ENOMEM\n",
                "x",
            ),
        ];
        for (msg, name) in named {
            assert_eq!(failed_program(msg), Some(name), "{msg}");
        }
        let not = [
            "libbpf: prog 'tb_uring_submit': relo #4: insn #12 (LDX/ST/STX) unexpected mem size: got 1, exp 8\n",
            "libbpf: failed to perform CO-RE relocations: -EINVAL\n",
            "libbpf: prog 'irq_entry': failed to attach: No such file or directory\n",
            "libbpf: prog 'a: failed to load\n",
            "libbpf: map 'rqs': failed to create: -12\n",
        ];
        for msg in not {
            assert_eq!(failed_program(msg), None, "{msg}");
        }
    }

    /// The planner names programs by string (it is pure and unit-tested on the
    /// facts of real kernels); this ties those names to the object itself: every
    /// name it can enable exists, and every program of the object is either
    /// always loaded or known to the planner as optional. Opening parses the
    /// object only: no kernel is involved.
    #[test]
    fn the_planners_program_names_are_the_objects() {
        let mut storage = MaybeUninit::uninit();
        let open = ViotraceGuestSkelBuilder::default()
            .open(&mut storage)
            .expect("open the embedded BPF object");
        let in_object: BTreeSet<String> = open
            .open_object()
            .progs()
            .map(|p| p.name().to_string_lossy().into_owned())
            .collect();
        let planned: Vec<&str> = HOOKS
            .iter()
            .flat_map(|h| h.fentry.iter().chain(h.kprobe.iter()))
            .chain(plan::OPTIONAL_TP_PROGS.iter())
            .chain(
                crate::probe::SYSCALLS
                    .iter()
                    .flat_map(|s| [&s.enter, &s.exit]),
            )
            .chain(SYS_TP_PROGS.iter())
            .copied()
            .collect();
        for name in &planned {
            assert!(
                in_object.contains(*name),
                "{name} is not a program of the object"
            );
        }
        // Programs declared optional in C (`SEC("?…")`) are the planner's to enable.
        for p in open.open_object().progs() {
            let name = p.name().to_string_lossy().into_owned();
            if !p.autoload() {
                assert!(
                    plan::is_optional(&name),
                    "{name} is optional in C but unknown to the planner"
                );
            }
        }
    }
}
