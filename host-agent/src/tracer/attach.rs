//! Starting to trace one QEMU process: its binary's layout (with a test-only
//! override), the optional parts the BPF side may use, and the uprobes.

use rustc_hash::FxHashSet;

use anyhow::{Context, Result};
use libbpf_rs::{MapCore, MapFlags, UprobeOpts};
use viotrace_shared::record::Point;

use super::{
    plain_bytes, Target, Tracer, QL_HAVE_LURING, QL_HAVE_MR_NEXT, QL_HAVE_NOTIFIER, QL_HAVE_REQ_IN,
    QL_IRQ_LEARN, QL_NO_SUBMIT,
};
use crate::bpf::types::qemu_layout;
use crate::qemu::layout::{apply_overrides, Layout};
use crate::qemu::verify::{Bounds, Probation};
use crate::qemu::{self, BinaryInfo, QemuProc};

/// Test hook: `[VM:]FIELD=VALUE[,FIELD=VALUE…][;[VM:]…]` replaces layout offsets
/// of the named VMs (all VMs without a `VM:` prefix) after the machine-code
/// confirmations, to prove that the runtime check refuses a wrong layout.
pub const LAYOUT_OVERRIDE_ENV: &str = "VIOTRACE_HOST_LAYOUT_OVERRIDE";

/// Test hook: `[VM:]SYMBOL[,SYMBOL…]` are treated as having no call site (as in an
/// LTO build), to prove the fallback on a binary that does call them.
pub const ASSUME_INLINED_ENV: &str = "VIOTRACE_HOST_ASSUME_INLINED";

/// The override spec for a VM from the value of [`LAYOUT_OVERRIDE_ENV`].
pub fn override_for(env: &str, vm: &str) -> Option<String> {
    let specs: Vec<&str> = env
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .filter_map(|item| {
            let (who, spec) = match item.split_once(':') {
                Some((who, spec)) if !who.contains('=') => (Some(who), spec),
                _ => (None, item),
            };
            who.is_none_or(|w| w == vm).then_some(spec)
        })
        .collect();
    (!specs.is_empty()).then(|| specs.join(","))
}

fn to_bpf(l: &Layout, flags: u32) -> qemu_layout {
    qemu_layout {
        vq_queue_index: l.vq_queue_index,
        vq_guest_notifier_wfd: l.vq_guest_notifier + 4, // EventNotifier { rfd, wfd }
        vq_host_notifier_rfd: l.vq_host_notifier,
        vq_vdev: l.vq_vdev,
        elem_index: l.elem_index,
        elem_out_num: l.elem_out_num,
        elem_in_num: l.elem_in_num,
        elem_in_sg: l.elem_in_sg,
        elem_out_sg: l.elem_out_sg,
        req_dev: l.req_dev,
        req_vq: l.req_vq,
        req_in: l.req_in,
        req_out: l.req_out,
        req_qiov_size: l.req_qiov_size,
        qiov_size: l.qiov_size,
        req_mr_next: l.req_mr_next,
        req_acct_start: l.req_acct_start,
        luring_sqe: l.luring_sqe.unwrap_or(0),
        flags,
        vdev_ok: 0,
        vdev_bad: 0,
        push_ok: 0,
        push_bad: 0,
    }
}

impl Tracer<'_> {
    /// Starts tracing a QEMU process. Returns warnings about what cannot be seen.
    pub fn add(&mut self, proc: QemuProc) -> Result<Vec<String>> {
        let pid = proc.pid;
        let mut info = BinaryInfo::read(&proc.exe)?;
        let mut warn = Vec::new();
        test_overrides(&proc.vm, &mut info, &mut warn)?;
        let layout = info.layout;
        if !info.probeable("virtqueue_push") {
            anyhow::bail!(
                "{} (pid {pid}): virtqueue_push is {}: virtqueue elements cannot be traced",
                proc.exe.display(),
                if info.has("virtqueue_push") {
                    "never called (inlined)"
                } else {
                    "not exported"
                }
            );
        }
        // By default every element is taken at virtqueue_push (one trap per
        // request). With --submit, blk_aio_* trap too, unless the build inlines
        // them (LTO).
        let lto = !info.probeable("blk_aio_preadv") || !info.probeable("blk_aio_pwritev");
        let no_submit = !self.submit || lto;
        let flags = self.flags_and_warnings(&info, no_submit, lto, &mut warn);
        let ql = to_bpf(&layout, flags);
        self.skel
            .maps
            .qemu_procs
            .update(&pid.to_ne_bytes(), plain_bytes(&ql), MapFlags::ANY)
            .context("registering the process in qemu_procs")?;
        let links = match self.attach_uprobes(&proc, &info, no_submit, &mut warn) {
            Ok(l) => l,
            Err(e) => {
                let _ = self.skel.maps.qemu_procs.delete(&pid.to_ne_bytes());
                return Err(e);
            }
        };
        for (what, e) in &self.missing_kernel {
            warn.push(format!("kernel probe {what} not attached: {e}"));
        }
        let cpu = qemu::cpu_ticks(pid);
        let bounds = Bounds {
            max_queues: proc.max_queues(),
            max_queue_size: proc.max_queue_size(),
        };
        let mut drive_ids: Vec<String> = proc.drives.iter().map(|d| d.id.clone()).collect();
        drive_ids.extend(proc.devices.iter().filter_map(|d| d.drive.clone()));
        self.targets.insert(
            pid,
            Target {
                proc,
                info,
                layout,
                links,
                dev_names: Default::default(),
                disk_labels: Default::default(),
                cpu_ticks_start: cpu,
                live: qemu::Liveness::new(pid),
                elems: 0,
                probation: Probation::default(),
                bounds,
                drive_ids,
                checked_vqs: FxHashSet::default(),
                seen_vqs: FxHashSet::default(),
                last_vq: 0,
                warned_no_block_push: false,
            },
        );
        Ok(warn)
    }

    fn attach_uprobes(
        &self,
        proc: &QemuProc,
        info: &BinaryInfo,
        no_submit: bool,
        warn: &mut Vec<String>,
    ) -> Result<Vec<libbpf_rs::Link>> {
        let pid = proc.pid;
        let progs = &self.skel.progs;
        let mut links = Vec::new();
        let pid_i = i32::try_from(pid).context("pid out of range")?;
        // Per guest request only virtqueue_push traps (and blk_aio_* with
        // --submit, virtio_notify with --irq where QEMU notifies without an
        // eventfd); h.notify and h.irq come from kernel tracepoints. --pop adds
        // two traps per pop and one per batch (five per request at queue depth 1).
        let mut attach_list: Vec<(&libbpf_rs::ProgramMut, &str, bool)> = vec![
            (&progs.submit_rw, "blk_aio_preadv", false),
            (&progs.submit_rw, "blk_aio_pwritev", false),
            (&progs.submit_flush, "blk_aio_flush", false),
            (&progs.submit_discard, "blk_aio_pdiscard", false),
            (&progs.submit_wzeroes, "blk_aio_pwrite_zeroes", false),
            (&progs.push, "virtqueue_push", false),
            (&progs.notify_direct, "virtio_notify", false),
        ];
        // --pop: virtio_blk_handle_vq registers each queue before its first
        // element is popped. Otherwise a queue is registered at its first push
        // (push-only) or submit: the kicks before it have no h.notify.
        if self.pop {
            attach_list.push((&progs.handle_vq, "virtio_blk_handle_vq", false));
        }
        // h.pop: the USDT probe when the build has it (one trap, no layout needed
        // for the element pointer), else a uprobe + uretprobe on virtqueue_pop.
        let mut usdt_pop = self.pop && info.usdt.contains("virtqueue_pop");
        if usdt_pop {
            match progs
                .usdt_pop
                .attach_usdt(pid_i, &proc.exe, "qemu", "virtqueue_pop")
            {
                Ok(l) => {
                    links.push(l);
                    warn.push(format!("{} from USDT qemu:virtqueue_pop", Point::HostPop));
                }
                Err(e) => {
                    warn.push(format!(
                        "USDT qemu:virtqueue_pop not attached ({e}): uprobes instead"
                    ));
                    usdt_pop = false;
                }
            }
        }
        if self.pop && !usdt_pop {
            attach_list.extend([
                (&progs.pop_enter, "virtqueue_pop", false),
                (&progs.pop_ret, "virtqueue_pop", true),
            ]);
        }
        if no_submit {
            attach_list.retain(|(_, f, _)| !f.starts_with("blk_aio_"));
        }
        if self.irq_learn(info) {
            attach_list.retain(|(_, f, _)| *f != "virtio_notify");
        }
        warn.extend(site_notes(info, attach_list.iter().map(|(_, f, _)| *f)));
        for (prog, func, ret) in attach_list {
            if !info.probeable(func) {
                continue;
            }
            // (a return probe reads no argument; an entry probe past the entry
            // reads a moved one where its site's cookie says)
            let cookie = match info.probe_site(func) {
                Some(site) if !ret => site.cookie(),
                _ => 0,
            };
            let opts = UprobeOpts {
                retprobe: ret,
                func_name: Some(func.to_string()),
                cookie,
                ..Default::default()
            };
            let skip = info.entry_offset(func) as usize;
            match prog.attach_uprobe_with_opts(pid_i, &proc.exe, skip, opts) {
                Ok(l) => links.push(l),
                Err(e) => {
                    if matches!(
                        func,
                        "virtqueue_push" | "blk_aio_preadv" | "blk_aio_pwritev"
                    ) {
                        return Err(anyhow::anyhow!("{e}"))
                            .with_context(|| format!("attaching uprobe {func} in pid {pid}"));
                    }
                    warn.push(format!("uprobe {func} not attached: {e}"));
                }
            }
        }
        Ok(links)
    }
}

/// What the uprobes' sites say about their cost: the targets probed past their
/// entry, on an instruction the kernel emulates; those whose hits each take a
/// single-step (no such instruction where the probe still sees the entry's
/// arguments: see `qemu::probe_site`).
fn site_notes<'a>(info: &BinaryInfo, funcs: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut moved = Vec::new();
    let mut stepped = Vec::new();
    let mut seen = FxHashSet::default();
    for f in funcs.filter(|f| info.probeable(f) && seen.insert(*f)) {
        let Some(site) = info.probe_site(f) else {
            continue;
        };
        if site.offset > 0 {
            let args: Vec<String> = site
                .moved
                .iter()
                .map(|(a, r)| format!("argument {} in {}", a + 1, format!("{r:?}").to_lowercase()))
                .collect();
            let args = if args.is_empty() {
                String::new()
            } else {
                format!("; {}", args.join(", "))
            };
            moved.push(format!("{f} +{:#x} ({}{args})", site.offset, site.insn));
        }
        if !site.emulated {
            stepped.push(format!("{f} ({})", site.insn));
        }
    }
    let mut out = Vec::new();
    if !moved.is_empty() {
        out.push(format!(
            "uprobes placed past their entry, on an instruction the kernel emulates or past \
             endbr64: {}",
            moved.join(", ")
        ));
    }
    if !stepped.is_empty() {
        out.push(format!(
            "uprobes single-stepped at each hit (a second trap; no emulated instruction \
             before the arguments change): {}",
            stepped.join(", ")
        ));
    }
    out
}

/// The test-only overrides of a VM's layout and of which symbols count as inlined.
fn test_overrides(vm: &str, info: &mut BinaryInfo, warn: &mut Vec<String>) -> Result<()> {
    if let Ok(env) = std::env::var(LAYOUT_OVERRIDE_ENV) {
        if let Some(spec) = override_for(&env, vm) {
            let done = apply_overrides(&mut info.layout, &spec)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("{LAYOUT_OVERRIDE_ENV}={env}"))?;
            warn.push(format!(
                "TEST OVERRIDE ({LAYOUT_OVERRIDE_ENV}): {}",
                done.join(", ")
            ));
        }
    }
    if let Ok(env) = std::env::var(ASSUME_INLINED_ENV) {
        if let Some(list) = override_for(&env, vm) {
            let syms: Vec<&str> = list.split(',').map(str::trim).collect();
            warn.push(format!(
                "TEST OVERRIDE ({ASSUME_INLINED_ENV}): treated as never called: {}",
                syms.join(", ")
            ));
            info.never_called.extend(syms.iter().map(|s| s.to_string()));
        }
    }
    Ok(())
}

impl Tracer<'_> {
    /// The flags the BPF side gets for a process, and what cannot be seen in it.
    fn flags_and_warnings(
        &self,
        info: &BinaryInfo,
        no_submit: bool,
        lto: bool,
        warn: &mut Vec<String>,
    ) -> u32 {
        for (sym, what, why) in info.missing(self.pop) {
            warn.push(format!("not visible: {what} ({sym} {why})"));
        }
        if self.submit && lto {
            warn.push(format!(
                "--submit: blk_aio_preadv/pwritev are not probeable (inlined): elements are \
                     read at virtqueue_push, {} from QEMU's block accounting",
                Point::HostSubmit
            ));
        } else if no_submit {
            warn.push(format!(
                "one trap per request: elements are read at virtqueue_push (op, sector, \
                     bytes from the element), {} is QEMU's block accounting start of the \
                     request (add --submit to trap the backend submit: one more hit per request)",
                Point::HostSubmit
            ));
        }
        if !info.usdt.is_empty() {
            warn.push(format!(
                "the binary carries {} USDT probes of provider qemu (used: virtqueue_pop with \
                     --pop)",
                info.usdt.len()
            ));
        }
        if !self.pop {
            warn.push(format!(
                "stage {} not traced (add --pop: 3 more uprobe hits per request)",
                Point::HostPop
            ));
        }
        warn.push(format!(
            "stage {} not visible: QEMU's completion callbacks are static functions",
            Point::HostCompleteCb
        ));
        let mut flags = QL_HAVE_MR_NEXT | QL_HAVE_REQ_IN;
        if info.layout.luring_sqe.is_some() {
            flags |= QL_HAVE_LURING;
        } else {
            warn.push(format!(
                "aio=io_uring: {}/{} not matched (QEMU {} keeps no SQE copy per request)",
                Point::HostIoIssue,
                Point::HostIoComplete,
                info.version.as_deref().unwrap_or("?")
            ));
        }
        if no_submit {
            flags |= QL_NO_SUBMIT;
        }
        // 10.2+ has no virtio_notify_irqfd: virtio_notify is the one path.
        let notify_path = info.has("virtio_notify_irqfd") || info.probeable("virtio_notify");
        if notify_path && self.kernel_probe_attached("irq_write") {
            flags |= QL_HAVE_NOTIFIER;
            if self.irq_learn(info) {
                flags |= QL_IRQ_LEARN;
                warn.push(format!(
                    "{} only on queues whose guest notifier eventfd QEMU writes (an iothread's): \
                     QEMU {} raises a main-loop queue's interrupt in virtio_notify, without one \
                     (add --irq to trap it: one more hit per request)",
                    Point::HostIrq,
                    info.version.as_deref().unwrap_or("of unknown version")
                ));
            }
        }
        flags
    }

    /// Whether h.irq is left to the guest notifier eventfd (QL_IRQ_LEARN): no
    /// virtio_notify probe on a build that may notify without the eventfd, unless
    /// --irq asks for it.
    fn irq_learn(&self, info: &BinaryInfo) -> bool {
        !self.irq && info.may_notify_without_eventfd() && info.probeable("virtio_notify")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_per_vm() {
        let env = "victim:req_out=0x90;all_vq=1";
        assert_eq!(
            override_for(env, "victim").as_deref(),
            Some("req_out=0x90,all_vq=1")
        );
        assert_eq!(override_for(env, "other").as_deref(), Some("all_vq=1"));
        assert_eq!(override_for("a:x=1", "b"), None);
        assert_eq!(override_for("", "b"), None);
        // A C name has no ':' but may be given with a VM prefix.
        assert_eq!(
            override_for("v:VirtIOBlockReq.out=8", "v").as_deref(),
            Some("VirtIOBlockReq.out=8")
        );
    }

    #[test]
    fn bpf_layout_carries_the_offsets() {
        let (l, _) = crate::qemu::layout::select(crate::qemu::layout::Version::parse("10.2.0"));
        let q = to_bpf(&l, QL_HAVE_MR_NEXT);
        assert_eq!(q.vq_guest_notifier_wfd, l.vq_guest_notifier + 4);
        assert_eq!(q.luring_sqe, 0);
        assert_eq!(q.flags, QL_HAVE_MR_NEXT);
    }
}
