//! Loads the BPF object, attaches the kernel tracepoints once and the QEMU
//! uprobes per traced process, and turns ring-buffer records into [`HostElem`]s.

use rustc_hash::{FxHashMap, FxHashSet};
use std::mem::MaybeUninit;
use std::path::Path;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, OpenObject};
use viotrace_shared::interference::DeviceLoad;
use viotrace_shared::record::{Backend, HostElem, Name, Op, Point, Points};
use viotrace_shared::selfcost::BpfRuns;

use crate::bpf::types::{
    dev_user, host_rec, pushed_key, qemu_layout, rq_owner, tg_ptr, vq_state, wait_rec,
};
use crate::bpf::{ViotraceHostSkel, ViotraceHostSkelBuilder};
use crate::qemu::verify::{Bounds, Probation, Standing};
use crate::qemu::{self, BinaryInfo, Layout, QemuProc};

/// The programs of QEMU threads' run-queue waits (bpf/host/host_interfere.h).
const SCHED_PROGS: [&str; 3] = ["qemu_wakeup", "qemu_wakeup_new", "qemu_switch"];

/// `host_rec.ts` slot → point, matched by name from the generated `TS_POINT_NAMES`.
fn ts_points() -> &'static [Option<Point>] {
    static P: std::sync::OnceLock<Vec<Option<Point>>> = std::sync::OnceLock::new();
    P.get_or_init(|| TS_POINT_NAMES.iter().map(|n| Point::from_name(n)).collect())
}

// Counter names (STAT_NAMES) and the QL_*/HR_* flags, generated from bpf/host/viotrace_host.bpf.h.
include!(concat!(env!("OUT_DIR"), "/host_abi.rs"));

/// host_rec.flags (HR_*).
mod attach;
mod check;

/// One traced QEMU process.
pub struct Target {
    pub proc: QemuProc,
    pub info: BinaryInfo,
    pub layout: Layout,
    links: Vec<Link>,
    /// VirtIODevice pointer → device label.
    dev_names: FxHashMap<u64, (Name, Backend)>,
    /// Host block device (MKDEV) → label (`vda (254:0)`), read from /sys once per device.
    disk_labels: FxHashMap<u32, Name>,
    pub cpu_ticks_start: Option<u64>,
    /// Whether the process still runs, checked once a second.
    pub live: crate::qemu::Liveness,
    pub elems: u64,
    /// The runtime check of the layout on the first requests.
    pub probation: Probation<host_rec>,
    bounds: Bounds,
    /// Drive ids the command line defines (for the VirtIOBlock.blk check).
    drive_ids: Vec<String>,
    /// Queues whose notifiers and device were checked in the process's memory.
    checked_vqs: FxHashSet<u64>,
    /// Queues that had records (those the sweep looks at, with the last one
    /// seen: records come in runs of one queue).
    seen_vqs: FxHashSet<u64>,
    last_vq: u64,
    /// Whether the push-only "no block element" warning was given.
    warned_no_block_push: bool,
}

pub struct Tracer<'obj> {
    pub skel: ViotraceHostSkel<'obj>,
    _tp_links: Vec<Link>,
    pub targets: FxHashMap<u32, Target>,
    /// Kernel-side stages that could not be attached, with the error.
    pub missing_kernel: Vec<(String, String)>,
    /// Also probe virtqueue_pop (h.pop): two traps per pop, the batch's closing
    /// empty pop included, plus one per batch (five more per request at queue
    /// depth 1); with USDT one per element popped plus one per batch.
    pub pop: bool,
    /// Also probe blk_aio_* (exact h.submit, merges) at one more trap per request.
    pub submit: bool,
    /// Also probe virtio_notify (h.irq without an eventfd) at one more trap per request.
    pub irq: bool,
    /// Elements emitted by [`Tracer::sweep_unnotified`].
    unnotified: u64,
    /// VMs whose layout the runtime check refused, not yet taken by the caller.
    refusals: Vec<(u32, String)>,
    /// Warnings of the runtime check, not yet taken by the caller.
    notes: Vec<String>,
    /// Records of refused layouts that were dropped (VMs already let go).
    refused_dropped: u64,
}

impl<'obj> Tracer<'obj> {
    /// Detaches every probe (kernel tracepoints and every process's uprobes) in
    /// the background. Each detach waits for an RCU grace period (~50–100 ms);
    /// one thread per link lets those waits overlap. Join the handle before
    /// exiting.
    pub fn detach_all(&mut self) -> std::thread::JoinHandle<()> {
        let mut links = std::mem::take(&mut self._tp_links);
        for t in self.targets.values_mut() {
            links.append(&mut t.links);
        }
        std::thread::spawn(move || {
            std::thread::scope(|s| {
                for l in links {
                    s.spawn(move || drop(l));
                }
            })
        })
    }

    /// Loads the object and attaches the kernel probes; `sched`: also the
    /// run-queue waits of QEMU's threads (the why-slow evidence, `-t` in joined mode).
    pub fn open(
        storage: &'obj mut MaybeUninit<OpenObject>,
        pop: bool,
        submit: bool,
        irq: bool,
        sched: bool,
    ) -> Result<Tracer<'obj>> {
        let mut open = ViotraceHostSkelBuilder::default()
            .open(storage)
            .context("opening the BPF object")?;
        // block_io_start (6.5+): without it the submitter of a request dispatched
        // later is taken from its insertion into the I/O scheduler (block_rq_insert).
        if !Path::new("/sys/kernel/tracing/events/block/block_io_start").exists() {
            open.progs.rq_io_start.set_autoload(false);
        }
        // block_rq_merge (5.9+): without it a merged-away request's origin stays until
        // the LRU evicts it or a request at its address starts (an insertion alone keeps it).
        if !Path::new("/sys/kernel/tracing/events/block/block_rq_merge").exists() {
            open.progs.rq_merged.set_autoload(false);
        }
        let mut skel = open.load().context("loading the BPF programs")?;
        trim_heap();
        let mut tp_links = Vec::new();
        let mut missing_kernel = Vec::new();
        for prog in skel.object_mut().progs_mut() {
            let sec = prog.section().to_string_lossy().into_owned();
            let name = prog.name().to_string_lossy().into_owned();
            if !sched && SCHED_PROGS.contains(&name.as_str()) {
                continue;
            }
            let res = if sec.starts_with("tracepoint/") || sec.starts_with("tp_btf/") {
                prog.attach()
            } else {
                continue; // uprobes: per process
            };
            match res {
                Ok(l) => tp_links.push(l),
                Err(e) => missing_kernel.push((format!("{name} ({sec})"), e.to_string())),
            }
        }
        Ok(Tracer {
            skel,
            _tp_links: tp_links,
            targets: FxHashMap::default(),
            missing_kernel,
            pop,
            submit,
            irq,
            unnotified: 0,
            refusals: Vec::new(),
            notes: Vec::new(),
            refused_dropped: 0,
        })
    }

    /// Stops tracing a process: detaches its uprobes, forgets its kernel state and
    /// returns the elements that were complete but still waiting for h.irq.
    pub fn remove(&mut self, pid: u32) -> (Option<Target>, Vec<host_rec>, u64) {
        let mut t = self.targets.remove(&pid);
        if let Some(t) = t.as_mut() {
            t.links.clear(); // detaches the uprobes
        }
        // A refused layout's records are garbage: none is emitted.
        let refused = t
            .as_ref()
            .is_some_and(|t| matches!(t.probation.standing, Standing::Refused));
        let _ = self.skel.maps.qemu_procs.delete(&pid.to_ne_bytes());
        let mut leftover = Vec::new();
        let mut abandoned = 0;
        let maps = &self.skel.maps;
        // Keys starting with the tgid.
        // 0: pushed (emit), 1: elems (abandoned), 2: forget
        for (map, kind) in [
            (&maps.pushed, 0),
            (&maps.elems, 1),
            (&maps.vqs, 2),
            (&maps.ios, 2),
            (&maps.io_by_buf, 2),
        ] {
            let keys: Vec<Vec<u8>> = map
                .keys()
                .filter(|k| k.len() >= 4 && k[..4] == pid.to_ne_bytes())
                .collect();
            for k in keys {
                if kind == 0 {
                    if let Ok(Some(v)) = map.lookup(&k, MapFlags::ANY) {
                        if let Some(r) = parse_rec(&v) {
                            leftover.push(r);
                        }
                    }
                } else if kind == 1 {
                    abandoned += 1;
                }
                let _ = map.delete(&k);
            }
        }
        // Values starting with the tgid (struct tid_io).
        for map in [&maps.tid_ios, &maps.rq_ios, &maps.uring_ios] {
            let keys: Vec<Vec<u8>> = map
                .keys()
                .filter(|k| {
                    map.lookup(k, MapFlags::ANY)
                        .ok()
                        .flatten()
                        .is_some_and(|v| v.len() >= 4 && v[..4] == pid.to_ne_bytes())
                })
                .collect();
            for k in keys {
                let _ = map.delete(&k);
            }
        }
        leftover.sort_by_key(|r| r.ts[8]);
        if let Some(t) = t.as_mut() {
            if refused {
                t.probation.dropped += leftover.len() as u64;
                leftover.clear();
                self.refused_dropped += t.probation.dropped;
            } else {
                // Still held by the check (the VM went away early): they passed it.
                let held = std::mem::take(&mut t.probation.held);
                leftover.splice(0..0, held);
            }
        }
        (t, leftover, abandoned)
    }

    /// Takes the elements that have waited longer than `max_age_ns` for a guest
    /// notification (QEMU may skip one when the guest does not ask for it, and an
    /// idle queue sends no later one), so they reach the join in time, without h.irq.
    /// A notification racing with this sweep can emit an element twice (microsecond
    /// window, after `max_age_ns` of waiting); the join then reports the copy unmatched.
    ///
    /// Per virtqueue, only from its oldest waiting element on: they wait in push
    /// order (`flush_seq..push_seq`), so the walk stops at the first young one.
    /// (Walking the whole `pushed` map cost a scan of its 16 k buckets per sweep.)
    ///
    /// With `all`, every queue of the `vqs` map (a walk of its 4k buckets, one
    /// system call per queue); else only the queues that had records (a queue
    /// whose every element so far waits unnotified is found by the next walk).
    pub fn sweep_unnotified(&mut self, now_ns: u64, max_age_ns: u64, all: bool) -> Vec<host_rec> {
        let maps = &self.skel.maps;
        let mut out = Vec::new();
        let vq_keys: Vec<Vec<u8>> = if all {
            maps.vqs.keys().collect()
        } else {
            (self.targets.iter())
                .flat_map(|(&tgid, t)| {
                    t.seen_vqs
                        .iter()
                        .map(move |&ptr| plain_bytes(&tg_ptr { tgid, pad: 0, ptr }).to_vec())
                })
                .collect()
        };
        for vk in vq_keys {
            let Some(k) = parse::<tg_ptr>(&vk) else {
                continue;
            };
            let st = maps.vqs.lookup(&vk, MapFlags::ANY).ok().flatten();
            let Some(st) = st.as_deref().and_then(parse::<vq_state>) else {
                continue;
            };
            let waiting = st.push_seq.saturating_sub(st.flush_seq).min(MAX_PENDING);
            for seq in st.flush_seq..st.flush_seq + waiting {
                let pk = pushed_key {
                    tgid: k.tgid,
                    pad: 0,
                    vq: k.ptr,
                    seq,
                };
                let pk = plain_bytes(&pk);
                // (gone: taken by an earlier sweep)
                let Some(r) = maps.pushed.lookup(pk, MapFlags::ANY).ok().flatten() else {
                    continue;
                };
                let Some(pushed) = parse_rec(&r).map(|r| r.ts[8]) else {
                    continue;
                };
                if pushed != 0 && now_ns.saturating_sub(pushed) < max_age_ns {
                    break;
                }
                if let Ok(Some(v)) = maps.pushed.lookup_and_delete(pk) {
                    if let Some(r) = parse_rec(&v) {
                        self.unnotified += 1;
                        out.push(r);
                    }
                }
            }
        }
        out.sort_by_key(|r| r.ts[8]);
        out
    }

    /// The per-(device, issuer) block request counters (`dev_users`).
    pub fn device_issuers(&self) -> Vec<(rq_owner, dev_user)> {
        let map = &self.skel.maps.dev_users;
        map.keys()
            .filter_map(|k| {
                let v = map.lookup(&k, MapFlags::ANY).ok().flatten()?;
                Some((parse(&k)?, parse(&v)?))
            })
            .collect()
    }

    /// One kernel-side counter (`index` in `STAT_NAMES`); 0 when unreadable.
    fn stat(&self, index: usize) -> u64 {
        let k = (index as u32).to_ne_bytes();
        (self
            .skel
            .maps
            .stats
            .lookup(&k, MapFlags::ANY)
            .ok()
            .flatten())
        .and_then(|v| {
            v.get(..8)
                .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
        })
        .unwrap_or(0)
    }

    /// Execs of QEMU binaries seen by the kernel so far, when that probe is
    /// attached (else the discovery cannot wait for one).
    pub fn qemu_execs(&self) -> Option<u64> {
        let i = STAT_NAMES.iter().position(|n| *n == "qemu_execs")?;
        self.kernel_probe_attached("proc_exec")
            .then(|| self.stat(i))
    }

    /// Whether the kernel program `prog` attached (see `missing_kernel`).
    pub fn kernel_probe_attached(&self, prog: &str) -> bool {
        !self.missing_kernel.iter().any(|m| m.0.starts_with(prog))
    }

    /// The kernel's ids of this agent's loaded programs.
    fn prog_ids(&self) -> FxHashSet<u32> {
        use std::os::fd::AsFd;
        self.skel
            .object()
            .progs()
            .filter_map(|p| libbpf_rs::Program::id_from_fd(p.as_fd()).ok())
            .collect()
    }

    /// The kernel's run time and run count of this agent's programs, summed (both 0
    /// while the kernel does not measure them: `kernel.bpf_stats_enabled`).
    pub fn bpf_runs(&self) -> BpfRuns {
        let ids = self.prog_ids();
        libbpf_rs::query::ProgInfoIter::default()
            .filter(|i| ids.contains(&i.id))
            .fold(BpfRuns::default(), |a, i| BpfRuns {
                ns: a.ns + i.run_time_ns,
                runs: a.runs + i.run_cnt,
            })
    }

    /// The verifier's work at load: instructions processed, summed over this agent's
    /// programs, and the largest program's (name, instructions). None before Linux
    /// 5.16, which does not report it. A program is refused past 1 M: the largest
    /// one's distance from that is the margin a kernel's verifier change eats.
    pub fn verified_insns(&self) -> Option<(u64, (String, u32))> {
        let ids = self.prog_ids();
        let mut sum = 0u64;
        let mut top = (String::new(), 0u32);
        for i in libbpf_rs::query::ProgInfoIter::default().filter(|i| ids.contains(&i.id)) {
            sum += u64::from(i.verified_insns);
            if i.verified_insns > top.1 {
                top = (i.name.to_string_lossy().into_owned(), i.verified_insns);
            }
        }
        (sum > 0).then_some((sum, top))
    }

    /// Reads the kernel-side counters.
    pub fn stats(&self) -> Vec<(&'static str, u64)> {
        let mut out = Vec::new();
        for (i, name) in STAT_NAMES.iter().enumerate() {
            out.push((*name, self.stat(i)));
        }
        out.push(("emitted_without_notification", self.unnotified));
        out.push(("refused_layout_records_dropped", self.refused_dropped));
        out
    }

    /// A record built for an entry of a trusted VM (see check.rs for the others).
    fn build(t: &mut Target, r: &host_rec) -> HostElem {
        t.elems += 1;
        if r.vq != t.last_vq {
            t.last_vq = r.vq;
            t.seen_vqs.insert(r.vq);
        }
        let (device, backend) = match t.dev_names.get(&r.dev) {
            Some(v) => v.clone(),
            None => {
                let v = name_device(t, r.dev);
                t.dev_names.insert(r.dev, v.clone());
                v
            }
        };
        let disk = (r.disk_dev != 0).then(|| {
            t.disk_labels
                .entry(r.disk_dev)
                .or_insert_with(|| crate::interfere::disk_label(r.disk_dev).into())
                .clone()
        });
        make_elem(r, &t.proc.vm, device, backend, disk)
    }

    /// Builds a record for an element of a process that already went away.
    pub fn record_of_gone(t: &Target, r: &host_rec) -> HostElem {
        let (device, backend) = t
            .dev_names
            .get(&r.dev)
            .cloned()
            .unwrap_or_else(|| fallback_device(t));
        let disk = (r.disk_dev != 0).then(|| {
            (t.disk_labels.get(&r.disk_dev).cloned())
                .unwrap_or_else(|| crate::interfere::disk_label(r.disk_dev).into())
        });
        make_elem(r, &t.proc.vm, device, backend, disk)
    }
}

fn fallback_device(t: &Target) -> (Name, Backend) {
    match t.proc.devices.as_slice() {
        [only] => (
            only.id
                .as_deref()
                .or(only.drive.as_deref())
                .unwrap_or("virtio-blk")
                .into(),
            t.proc.backend_of(Some(only)),
        ),
        _ => ("virtio-blk".into(), t.proc.backend_of(None)),
    }
}

fn name_device(t: &Target, vdev: u64) -> (Name, Backend) {
    match qemu::device_drive(t.proc.pid, vdev, &t.layout) {
        Some(drive) => {
            let dev = t
                .proc
                .devices
                .iter()
                .find(|d| d.drive.as_deref() == Some(drive.as_str()));
            let label = dev.and_then(|d| d.id.clone()).unwrap_or(drive.clone());
            let backend = match t.proc.drives.iter().find(|d| d.id == drive) {
                Some(d) => d.backend,
                None => t.proc.backend_of(dev),
            };
            (label.into(), backend)
        }
        None => {
            let (name, b) = fallback_device(t);
            if t.proc.devices.len() > 1 {
                (compact_str::format_compact!("virtio-blk@{vdev:#x}"), b)
            } else {
                (name, b)
            }
        }
    }
}

/// `host_disk`: the label of `r.disk_dev` (none when the I/O reached no block device).
fn make_elem(
    r: &host_rec,
    vm: &str,
    device: Name,
    backend: Backend,
    host_disk: Option<Name>,
) -> HostElem {
    let mut ts = Points::new();
    for (p, &t) in ts_points().iter().zip(r.ts.iter()) {
        if let Some(p) = p {
            ts.set_nonzero(*p, t);
        }
    }
    HostElem {
        time: viotrace_shared::walltime::of_points(&ts),
        vm: vm.into(),
        qemu_pid: r.tgid,
        device,
        queue: r.queue,
        head: r.head,
        op: Op::from_virtio_type(r.r#type),
        sector: r.sector,
        bytes: r.bytes,
        backend,
        merge_id: r.merge_id,
        status: (r.has_status != 0).then_some(r.status),
        ts,
        interference: host_disk.map(|d| device_load(r, d)),
    }
}

/// The host device load of a record's backend I/O.
fn device_load(r: &host_rec, host_disk: Name) -> DeviceLoad {
    DeviceLoad {
        host_disk: Some(host_disk),
        neighbour_inflight: Some(r.nb_inflight),
        neighbour_issued: Some(r.nb_issued),
        neighbour_bytes: Some(r.nb_bytes),
    }
}

/// The skeleton's `#[repr(C)]` copies of C structs made of integers and integer
/// arrays only: any bit pattern is a valid value.
pub trait Plain: Copy {}
impl Plain for host_rec {}
impl Plain for wait_rec {}
impl Plain for dev_user {}
impl Plain for rq_owner {}
impl Plain for tg_ptr {}
impl Plain for vq_state {}
impl Plain for pushed_key {}
impl Plain for qemu_layout {}

/// Pushed elements waiting for a notification, per queue (`MAX_PENDING` in
/// host_common.h): the BPF side emits older ones itself.
const MAX_PENDING: u64 = 256;

/// Reads a ring-buffer record or map value as a generated BPF type (one checked read).
pub fn parse<T: Plain>(b: &[u8]) -> Option<T> {
    if b.len() < std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: `b` holds at least `size_of::<T>()` bytes (checked above); `T` is
    // `Plain` (integers and integer arrays only, so any bit pattern is a valid
    // value); `read_unaligned` needs no alignment of the ring buffer's bytes.
    Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

/// Parses a ring-buffer/map value into a `host_rec`.
pub fn parse_rec(b: &[u8]) -> Option<host_rec> {
    parse(b)
}

/// The bytes of a generated BPF type, e.g. a map key.
pub(crate) fn plain_bytes<T: Plain>(v: &T) -> &[u8] {
    // SAFETY: `T` is `Plain`: a #[repr(C)] type generated by libbpf-cargo from
    // integers and integer arrays with explicit padding fields, so every byte
    // is initialised; the slice borrows `v` for its whole size.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// Mounts tracefs when it is not mounted (tracepoint attach needs it).
pub fn ensure_tracefs() -> Result<()> {
    let p = Path::new("/sys/kernel/tracing");
    if p.join("events").exists() {
        return Ok(());
    }
    let st = std::process::Command::new("mount")
        .args(["-t", "tracefs", "none", "/sys/kernel/tracing"])
        .status()
        .context("running mount -t tracefs")?;
    if !st.success() {
        anyhow::bail!("mounting tracefs on /sys/kernel/tracing failed ({st})");
    }
    Ok(())
}

/// Gives the heap memory that loading freed (libbpf's parse of the kernel's BTF,
/// about 10 MiB) back to the kernel: glibc would keep it, and it would stay in
/// the agent's RSS for as long as it runs. Also run every 10 s (the join's
/// bursts of buffered records are freed into every thread's arena).
pub fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free pages of glibc's own heap; it touches
    // no memory Rust owns.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_read_as_the_generated_type() {
        let mut r = host_rec::default();
        r.ts[0] = 5;
        r.sector = 2048;
        r.r#type = 1;
        r.head = 7;
        r.has_status = 1;
        // SAFETY: a `#[repr(C)]` value viewed as its own bytes, for the test only.
        let b = unsafe {
            std::slice::from_raw_parts(
                (&r as *const host_rec).cast::<u8>(),
                std::mem::size_of::<host_rec>(),
            )
        };
        let p = parse_rec(b).unwrap();
        assert_eq!(
            (p.ts[0], p.sector, p.r#type, p.head, p.has_status),
            (5, 2048, 1, 7, 1)
        );
        assert!(parse_rec(&b[..100]).is_none());
        assert_eq!(STAT_NAMES[0], "ringbuf_drops");
        assert_eq!((QL_HAVE_NOTIFIER, HR_HAVE_BYTES), (1, 8));
        // Every slot of host_rec.ts names a host point, and every host point has a slot.
        assert_eq!(ts_points().len(), r.ts.len());
        assert!(
            ts_points().iter().all(Option::is_some),
            "{TS_POINT_NAMES:?}"
        );
        let host_points = Point::ALL.iter().filter(|p| p.name().starts_with("h."));
        assert_eq!(host_points.count(), ts_points().len());
    }
}
