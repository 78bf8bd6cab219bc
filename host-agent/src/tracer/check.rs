//! Ring-buffer records through the runtime layout check: a VM's first records
//! are held until they pass; a failure refuses the VM's layout (its BPF state is
//! dropped at once, so nothing more is traced from it) and is reported to the
//! caller, which stops tracing that VM only.

use std::time::Instant;

use libbpf_rs::{MapCore, MapFlags};
use viotrace_shared::record::HostElem;

use super::{Target, Tracer, HR_HAVE_BYTES, HR_HDR_FAULT, QL_HAVE_NOTIFIER};
use crate::bpf::types::{host_rec, qemu_layout};
use crate::qemu::proc::{fd_target, read_i32, read_ptr};
use crate::qemu::verify::{
    check_record, check_view, Failure, ProcView, Seen, Standing, PUSH_MISMATCH_WARN,
    VDEV_MISMATCH_LIMIT,
};
use crate::qemu::{self};

fn seen_of(r: &host_rec) -> Seen {
    Seen {
        vq: r.vq,
        dev: r.dev,
        queue: r.queue,
        head: r.head,
        vtype: r.r#type,
        sector: r.sector,
        bytes: (u32::from(r.flags) & HR_HAVE_BYTES != 0).then_some(r.bytes),
        in_len: r.in_len,
        status: (r.has_status != 0).then_some(r.status),
        header_fault: u32::from(r.flags) & HR_HDR_FAULT != 0,
        pushed: r.ts[8] != 0,
    }
}

/// Reads what the process's memory says about a record's queue and device.
fn proc_view(t: &Target, r: &host_rec, notifiers: bool) -> ProcView {
    let pid = t.proc.pid;
    let l = &t.layout;
    let fd = |addr: u64| {
        let n = read_i32(pid, addr).filter(|&n| n >= 0)?;
        Some((n, fd_target(pid, n)?))
    };
    ProcView {
        host_notifier_fd: notifiers
            .then(|| fd(r.vq + u64::from(l.vq_host_notifier)))
            .flatten(),
        guest_notifier_fd: notifiers
            .then(|| fd(r.vq + u64::from(l.vq_guest_notifier) + 4))
            .flatten(),
        vq_vdev: read_ptr(pid, r.vq + u64::from(l.vq_vdev)),
        drive_name: qemu::device_drive(pid, r.dev, l),
    }
}

fn refusal(t: &Target, f: &Failure, r: Option<&host_rec>) -> String {
    let at = r.map_or(String::new(), |r| {
        format!(" (request queue {} head {})", r.queue, r.head)
    });
    format!(
        "layout REFUSED: {} looks wrong: {}{at}; QEMU {} ({}). This VM is not traced \
         further; other VMs are not affected",
        f.field,
        f.why,
        t.info.version.as_deref().unwrap_or("of unknown version"),
        t.info.basis
    )
}

impl Tracer<'_> {
    /// Hands `emit` the records of a ring-buffer entry, each built where it
    /// is passed on (not collected and moved again): none while the VM's
    /// layout is being checked (held), all held ones once it passes. False:
    /// not a traced VM.
    pub fn make_record(&mut self, r: &host_rec, mut emit: impl FnMut(HostElem)) -> bool {
        // (a map lookup, a system call: only for a queue not checked yet)
        let notifiers = self.targets.get(&r.tgid).is_some_and(|t| {
            matches!(t.probation.standing, Standing::Checking) && !t.checked_vqs.contains(&r.vq)
        }) && self.notifiers_in_use(r.tgid);
        let Some(t) = self.targets.get_mut(&r.tgid) else {
            return false;
        };
        match t.probation.standing {
            Standing::Trusted => {
                emit(Self::build(t, r));
                return true;
            }
            Standing::Refused => {
                t.probation.dropped += 1;
                return true;
            }
            Standing::Checking => {}
        }
        let seen = seen_of(r);
        let mut res = check_record(&seen, &t.bounds);
        if res.is_ok() && t.checked_vqs.insert(r.vq) {
            let view = proc_view(t, r, notifiers);
            res = check_view(&seen, &view, &t.drive_ids);
        }
        match res {
            Ok(()) => {
                let ready = t.probation.pass(*r, Instant::now());
                ready.iter().for_each(|x| emit(Self::build(t, x)));
            }
            Err(f) => {
                let msg = refusal(t, &f, Some(r));
                t.probation.dropped += 1; // the record that failed
                self.refuse(r.tgid, msg);
            }
        }
        true
    }

    fn notifiers_in_use(&self, pid: u32) -> bool {
        self.layout_of(pid)
            .is_some_and(|l| l.flags & QL_HAVE_NOTIFIER != 0)
    }

    /// The process's entry in qemu_procs (with the BPF-side check counters).
    fn layout_of(&self, pid: u32) -> Option<qemu_layout> {
        let v = self
            .skel
            .maps
            .qemu_procs
            .lookup(&pid.to_ne_bytes(), MapFlags::ANY)
            .ok()??;
        let u32_at = |o: usize| Some(u32::from_ne_bytes(v.get(o..o + 4)?.try_into().ok()?));
        Some(qemu_layout {
            flags: u32_at(std::mem::offset_of!(qemu_layout, flags))?,
            vdev_ok: u32_at(std::mem::offset_of!(qemu_layout, vdev_ok))?,
            vdev_bad: u32_at(std::mem::offset_of!(qemu_layout, vdev_bad))?,
            push_ok: u32_at(std::mem::offset_of!(qemu_layout, push_ok))?,
            push_bad: u32_at(std::mem::offset_of!(qemu_layout, push_bad))?,
            ..Default::default()
        })
    }

    fn refuse(&mut self, pid: u32, msg: String) {
        // Stop the BPF side for this process at once.
        let _ = self.skel.maps.qemu_procs.delete(&pid.to_ne_bytes());
        if let Some(t) = self.targets.get_mut(&pid) {
            t.probation.refuse();
        }
        self.refusals.push((pid, msg));
    }

    /// Periodic part of the check: the BPF-side counters (requests whose queue
    /// is not their device's), and the release of a quiet VM's held records.
    pub fn poll_probation(&mut self) -> Vec<HostElem> {
        let now = Instant::now();
        let checking: Vec<u32> = self
            .targets
            .iter()
            .filter(|(_, t)| matches!(t.probation.standing, Standing::Checking))
            .map(|(p, _)| *p)
            .collect();
        let mut out = Vec::new();
        for pid in checking {
            if let Some(l) = self.layout_of(pid) {
                self.warn_no_block_push(pid, &l);
                if self.refuse_bad_queue(pid, &l) {
                    continue;
                }
            }
            if let Some(t) = self.targets.get_mut(&pid) {
                let ready = t.probation.tick(now);
                out.extend(ready.iter().map(|x| Self::build(t, x)).collect::<Vec<_>>());
            }
        }
        out
    }

    /// Refuses the process when none of its block requests' queues (VirtIOBlockReq.vq)
    /// belongs to the request's device, over enough of them; true if refused.
    fn refuse_bad_queue(&mut self, pid: u32, l: &qemu_layout) -> bool {
        if l.vdev_ok != 0 || l.vdev_bad < VDEV_MISMATCH_LIMIT {
            return false;
        }
        let f = Failure {
            field: "VirtIOBlockReq.vq",
            why: format!(
                "on all {} block requests the queue (VirtIOBlockReq.vq) does not belong to \
                 the request's device (VirtIOBlockReq.dev, VirtQueue.vdev)",
                l.vdev_bad
            ),
        };
        let Some(t) = self.targets.get(&pid) else {
            return false;
        };
        let msg = refusal(t, &f, None);
        self.refuse(pid, msg);
        true
    }

    /// Push-only mode: many pushes and not one of a virtio-blk request whose
    /// device is its queue's (VirtIOBlockReq.dev, VirtQueue.vdev). Other devices'
    /// elements fail that check too, so this warns (once) instead of refusing.
    fn warn_no_block_push(&mut self, pid: u32, l: &qemu_layout) {
        if l.push_ok > 0 || l.push_bad < PUSH_MISMATCH_WARN {
            return;
        }
        if let Some(t) = self.targets.get_mut(&pid) {
            if !t.warned_no_block_push {
                t.warned_no_block_push = true;
                self.notes.push(format!(
                    "pid {pid}: {} virtqueue_push calls and none of a virtio-blk request of \
                     this process (VirtIOBlockReq.dev == VirtQueue.vdev): the VM has done no \
                     block I/O yet, or that layout is wrong (QEMU {})",
                    l.push_bad,
                    t.info.version.as_deref().unwrap_or("of unknown version")
                ));
            }
        }
    }

    /// The layout checks of a process about to be let go, from its final counts
    /// (the loop looks at them once a second: a VM may end in between): its
    /// warnings, and its refusal (see [`Self::take_refusals`]).
    pub fn last_checks(&mut self, pid: u32) {
        let checking = self
            .targets
            .get(&pid)
            .is_some_and(|t| matches!(t.probation.standing, Standing::Checking));
        if let Some(l) = self.layout_of(pid).filter(|_| checking) {
            self.warn_no_block_push(pid, &l);
            self.refuse_bad_queue(pid, &l);
        }
    }

    /// Notes for the log since the last call.
    pub fn take_notes(&mut self) -> Vec<String> {
        std::mem::take(&mut self.notes)
    }

    /// VMs refused since the last call, with the message.
    pub fn take_refusals(&mut self) -> Vec<(u32, String)> {
        std::mem::take(&mut self.refusals)
    }
}
