//! Interference evidence for the why-slow verdicts: the waits of QEMU's threads
//! for a CPU (the BPF `waits` ring buffer) and the heaviest issuers per host
//! block device (the BPF `dev_users` counters, read once a second), applied to
//! the joined requests above the threshold ([`Interfere::fill`]).
//!
//! Bounded: at most [`MAX_WAITS_PER_VM`] waits of the last [`HISTORY_NS`] are
//! kept per QEMU process (older ones are let go first; waits let go before
//! their time are counted), and the issuer table holds what the BPF map holds.

use std::collections::{HashMap, VecDeque};

use viotrace_shared::interference::overlap_ns;
use viotrace_shared::record::{ClockDomain, JoinedIo, Name, Point};

use crate::bpf::types::{dev_user, rq_owner, wait_rec};

/// How far back waits are kept (a judged request is at most this old).
pub const HISTORY_NS: u64 = 10_000_000_000;
/// Waits kept per QEMU process.
pub const MAX_WAITS_PER_VM: usize = 16_384;
/// Issuers named per device.
const TOP_ISSUERS: usize = 3;
/// Recent request windows kept per VM queue (for the queue overlap).
pub const MAX_WINDOWS_PER_QUEUE: usize = 512;

/// One QEMU thread's wait for a CPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Wait {
    pub start: u64,
    pub end: u64,
    /// A vCPU thread (QEMU names them `CPU n/KVM`, `CPU n/TCG`).
    pub vcpu: bool,
    /// The task that ran on that CPU just before the thread got it.
    pub holder_tgid: u32,
    pub holder_comm: Name,
}

#[derive(Default)]
pub struct Interfere {
    waits: HashMap<u32, VecDeque<Wait>>,
    /// Waits received, and those let go before [`HISTORY_NS`] (per-VM cap).
    pub waits_seen: u64,
    pub waits_evicted: u64,
    /// Requests the evidence was filled in for.
    pub filled: u64,
    /// Per (device, issuer): the issued count at the last refresh.
    last_issued: HashMap<(u32, u32), u64>,
    /// Per device: its other issuers of the last interval, (tgid, comm, requests), heaviest first.
    top: HashMap<u32, Vec<(u32, String, u64)>>,
    /// Traced QEMU processes and their VM labels (to name a neighbour VM).
    pub vms: HashMap<u32, String>,
    /// Per (VM, queue): the windows (first, last point) of its recent joined requests.
    windows: HashMap<(Name, u16), VecDeque<(u64, u64)>>,
}

/// A joined record's window in the host's clock: its first and last point.
fn window_of(j: &JoinedIo) -> Option<(u64, u64)> {
    if j.ts_domain != ClockDomain::Host {
        return None;
    }
    let from = j.ts.iter().map(|(_, t)| t).min()?;
    let to = j.ts.iter().map(|(_, t)| t).max()?;
    Some((from, to))
}

/// `vda (254:0)`, or `254:0` when the device has no name in /sys.
pub fn disk_label(dev: u32) -> String {
    let (major, minor) = (dev >> 20, dev & 0xf_ffff);
    let uevent = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/uevent"));
    let name = uevent.ok().and_then(|u| {
        u.lines()
            .find_map(|l| l.strip_prefix("DEVNAME=").map(str::to_string))
    });
    match name {
        Some(n) => format!("{n} ({major}:{minor})"),
        None => format!("{major}:{minor}"),
    }
}

/// The device of a [`disk_label`]: its `major:minor`.
fn dev_of_label(label: &str) -> Option<u32> {
    let mm = label.rsplit(['(', ' ']).next()?.trim_end_matches(')');
    let (ma, mi) = mm.split_once(':')?;
    Some((ma.parse::<u32>().ok()? << 20) | mi.parse::<u32>().ok()?)
}

/// A task name of the BPF side (NUL-padded), kept inline (no allocation: a
/// VM keeps up to MAX_WAITS_PER_VM of them).
fn c_str(b: &[i8]) -> Name {
    let mut bytes = [0u8; 16];
    let mut n = 0;
    for (d, &c) in bytes.iter_mut().zip(b.iter().take_while(|&&c| c != 0)) {
        *d = c as u8;
        n += 1;
    }
    Name::from_utf8_lossy(&bytes[..n])
}

impl Interfere {
    /// Takes one wait record of the BPF ring buffer.
    pub fn add_wait(&mut self, w: &wait_rec) {
        self.waits_seen += 1;
        let comm = c_str(&w.comm);
        let q = self.waits.entry(w.tgid).or_default();
        q.push_back(Wait {
            start: w.start,
            end: w.end,
            vcpu: comm.starts_with("CPU "),
            holder_tgid: w.holder_tgid,
            holder_comm: c_str(&w.holder_comm),
        });
        let newest = w.end;
        while let Some(f) = q.front() {
            if f.end + HISTORY_NS < newest {
                q.pop_front();
            } else if q.len() > MAX_WAITS_PER_VM {
                q.pop_front();
                self.waits_evicted += 1;
            } else {
                break;
            }
        }
    }

    /// Forgets a QEMU process that went away.
    pub fn forget(&mut self, tgid: u32) {
        self.waits.remove(&tgid);
        if let Some(vm) = self.vms.remove(&tgid) {
            self.windows.retain(|(v, _), _| *v != vm);
        }
    }

    /// Notes a joined request's window on its queue (every joined record, before
    /// [`Interfere::fill`]): at most [`MAX_WINDOWS_PER_QUEUE`] of the last
    /// [`HISTORY_NS`] per queue.
    pub fn note_request(&mut self, j: &JoinedIo) {
        let (Some(q), true, Some(w)) = (j.queue, j.joined, window_of(j)) else {
            return;
        };
        let d = match self.windows.get_mut(&(j.vm.clone(), q)) {
            Some(d) => d,
            None => self.windows.entry((j.vm.clone(), q)).or_default(),
        };
        d.push_back(w);
        while d
            .front()
            .is_some_and(|f| d.len() > MAX_WINDOWS_PER_QUEUE || f.1 + HISTORY_NS < w.1)
        {
            d.pop_front();
        }
    }

    /// Other noted requests of `j`'s VM queue whose windows overlap `j`'s.
    fn queue_overlap(&self, j: &JoinedIo) -> Option<u32> {
        let (q, w) = (j.queue?, window_of(j)?);
        let d = self.windows.get(&(j.vm.clone(), q))?;
        let n = d.iter().filter(|o| o.0 < w.1 && w.0 < o.1).count();
        // j itself was noted too
        Some(n.saturating_sub(usize::from(d.contains(&w))) as u32)
    }

    /// Once a second: the issuers of every device over the last interval, from
    /// the BPF per-(device, issuer) counters.
    pub fn refresh_issuers(&mut self, entries: impl Iterator<Item = (rq_owner, dev_user)>) {
        let mut top: HashMap<u32, Vec<(u32, String, u64)>> = HashMap::new();
        let mut seen = HashMap::new();
        for (k, v) in entries {
            let before = self.last_issued.get(&(k.dev, k.tgid)).copied().unwrap_or(0);
            seen.insert((k.dev, k.tgid), v.issued);
            let n = v.issued.saturating_sub(before);
            if n > 0 {
                top.entry(k.dev)
                    .or_default()
                    .push((k.tgid, c_str(&v.comm).to_string(), n));
            }
        }
        for v in top.values_mut() {
            v.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
        }
        self.last_issued = seen;
        self.top = top;
    }

    /// Fills the evidence of a joined request of QEMU `qemu_pid` (host clock):
    /// the neighbours on its device, QEMU's waits while it was in flight (first
    /// to last point: under TCG, or on a vCPU exit that needs QEMU's big lock, a
    /// preempted main loop stalls the guest's own stages too) and the vCPUs'
    /// waits around the kick and the interrupt.
    pub fn fill(&mut self, j: &mut JoinedIo) {
        let Some(tgid) = j.qemu_pid else { return };
        let mut ev = j.interference.take().map(|b| *b).unwrap_or_default();
        if let Some(dev) = ev.device.host_disk.as_deref().and_then(dev_of_label) {
            ev.neighbours = self.neighbours(dev, tgid);
        }
        let at = |p: Point| j.ts.get(p);
        let host_from = at(Point::HostNotify)
            .or(at(Point::HostPop))
            .or(at(Point::HostSubmit));
        let host_to = at(Point::HostIrq).or(at(Point::HostPush));
        // The whole request when its guest points are in the host's clock, else
        // its host part.
        let (from, to) = match window_of(j) {
            Some((a, b)) => (Some(a), Some(b)),
            None => (host_from, host_to),
        };
        let waits = self.waits.get(&tgid);
        let spans = |vcpu: bool| -> Vec<(u64, u64)> {
            waits
                .map(|q| {
                    q.iter()
                        .filter(|w| w.vcpu == vcpu)
                        .map(|w| (w.start, w.end))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut windows: Vec<(u64, u64)> = Vec::new();
        if let (Some(a), Some(b)) = (from, to) {
            ev.qemu_wait_ns = Some(overlap_ns(&spans(false), a, b));
            windows.push((a, b));
        }
        let vcpu = spans(true);
        let mut vcpu_ns = None;
        if let (Some(k), Some(p)) = (at(Point::Kick), at(Point::HostPop).or(host_from)) {
            *vcpu_ns.get_or_insert(0) += overlap_ns(&vcpu, k, p);
            windows.push((k, p));
        }
        if let (Some(n), Some(i)) = (host_to, at(Point::Irq)) {
            *vcpu_ns.get_or_insert(0) += overlap_ns(&vcpu, n, i);
            windows.push((n, i));
        }
        ev.vcpu_wait_ns = vcpu_ns;
        ev.cpu_holder = waits.and_then(|q| self.holder(q, &windows));
        ev.queue_overlap = self.queue_overlap(j);
        self.filled += 1;
        j.interference = Some(Box::new(ev));
    }

    fn neighbours(&self, dev: u32, own: u32) -> Vec<String> {
        let Some(v) = self.top.get(&dev) else {
            return Vec::new();
        };
        let others: Vec<&(u32, String, u64)> = v.iter().filter(|e| e.0 != own).collect();
        let sum: u64 = others.iter().map(|e| e.2).sum();
        others
            .iter()
            .take(TOP_ISSUERS)
            .map(|(tgid, comm, n)| {
                let who = match self.vms.get(tgid) {
                    Some(vm) => format!("vm {vm} (pid {tgid})"),
                    None => format!("pid {tgid} {comm}"),
                };
                format!("{who} {} %", n * 100 / sum.max(1))
            })
            .collect()
    }

    /// The task that held the CPU longest while the windows' waits lasted.
    fn holder(&self, q: &VecDeque<Wait>, windows: &[(u64, u64)]) -> Option<String> {
        let mut by: HashMap<(u32, &str), u64> = HashMap::new();
        for w in q {
            let ns: u64 = windows
                .iter()
                .map(|&(a, b)| overlap_ns(&[(w.start, w.end)], a, b))
                .sum();
            if ns > 0 {
                *by.entry((w.holder_tgid, w.holder_comm.as_str()))
                    .or_default() += ns;
            }
        }
        let ((tgid, comm), _) = by.into_iter().max_by_key(|e| (e.1, e.0))?;
        Some(match self.vms.get(&tgid) {
            Some(vm) => format!("vm {vm} (pid {tgid})"),
            None if tgid == 0 => "idle/kernel".to_string(),
            None => format!("pid {tgid} {comm}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use viotrace_shared::interference::{DeviceLoad, Interference};

    fn comm(s: &str) -> [i8; 16] {
        let mut c = [0i8; 16];
        for (d, b) in c.iter_mut().zip(s.bytes()) {
            *d = b as i8;
        }
        c
    }

    fn wait(tgid: u32, thread: &str, start: u64, end: u64, holder: u32, hc: &str) -> wait_rec {
        wait_rec {
            start,
            end,
            tgid,
            tid: tgid + 1,
            holder_tgid: holder,
            cpu: 1,
            comm: comm(thread),
            holder_comm: comm(hc),
        }
    }

    fn joined(ts: &[(&str, u64)]) -> JoinedIo {
        let pts: serde_json::Map<String, serde_json::Value> = ts
            .iter()
            .map(|(k, v)| (k.to_string(), (*v).into()))
            .collect();
        serde_json::from_value(serde_json::json!({
            "vm": "vm1", "disk": "vdb", "op": "read", "sector": 8, "bytes": 4096,
            "joined": true, "ts": pts, "ts_domain": "host", "stages": {}, "substages": {},
            "qemu_pid": 100,
        }))
        .unwrap()
    }

    #[test]
    fn waits_in_the_window_are_split_by_thread_kind_and_name_the_holder() {
        let mut f = Interfere::default();
        f.add_wait(&wait(100, "worker", 1_000, 6_000, 7, "hog"));
        f.add_wait(&wait(100, "worker", 5_000, 9_000, 8, "other")); // overlaps the first
        f.add_wait(&wait(100, "CPU 0/TCG", 500, 1_500, 7, "hog")); // before h.pop: kick window
        f.add_wait(&wait(200, "worker", 1_000, 9_000, 7, "hog")); // another VM
        f.add_wait(&wait(100, "worker", 50_000, 60_000, 7, "hog")); // after the request
        let mut j = joined(&[
            ("g.kick", 0),
            ("h.pop", 1_200),
            ("h.submit", 1_300),
            ("h.push", 20_000),
            ("h.irq", 20_100),
            ("g.irq", 21_000),
        ]);
        f.fill(&mut j);
        let i = j.interference.unwrap();
        // the request [0, 21000): worker waits 1000..9000 merged
        assert_eq!(i.qemu_wait_ns, Some(8_000));
        // kick window [0, 1200): the vCPU waited 500..1200
        assert_eq!(i.vcpu_wait_ns, Some(700));
        assert_eq!(i.cpu_holder.as_deref(), Some("pid 7 hog"));
    }

    #[test]
    fn queue_overlap_counts_the_vms_other_requests_on_the_queue() {
        let mut f = Interfere::default();
        let rq = |f: &mut Interfere, a: u64, b: u64, q: u16, vm: &str| {
            let mut j = joined(&[("h.submit", a), ("h.push", b)]);
            j.queue = Some(q);
            j.vm = vm.into();
            f.note_request(&j);
            j
        };
        rq(&mut f, 0, 50, 0, "vm1");
        rq(&mut f, 40, 200, 0, "vm1");
        rq(&mut f, 150, 300, 0, "vm1");
        rq(&mut f, 60, 70, 1, "vm1"); // other queue
        rq(&mut f, 60, 70, 0, "vm2"); // other VM
        let mut slow = rq(&mut f, 45, 160, 0, "vm1");
        f.fill(&mut slow);
        assert_eq!(slow.interference.unwrap().queue_overlap, Some(3));
        for k in 0..(MAX_WINDOWS_PER_QUEUE as u64 + 5) {
            rq(&mut f, 1000 + k, 1001 + k, 2, "vm1");
        }
        assert_eq!(f.windows[&("vm1".into(), 2)].len(), MAX_WINDOWS_PER_QUEUE);
    }

    #[test]
    fn history_is_bounded_and_evictions_counted() {
        let mut f = Interfere::default();
        for k in 0..(MAX_WAITS_PER_VM as u64 + 10) {
            f.add_wait(&wait(1, "worker", k * 10, k * 10 + 5, 2, "x"));
        }
        assert_eq!(f.waits[&1].len(), MAX_WAITS_PER_VM);
        assert_eq!(f.waits_evicted, 10);
        // a wait far later ages the old ones out (not counted as evictions)
        f.add_wait(&wait(
            1,
            "worker",
            HISTORY_NS * 3,
            HISTORY_NS * 3 + 5,
            2,
            "x",
        ));
        assert_eq!(f.waits[&1].len(), 1);
        assert_eq!(f.waits_evicted, 10);
    }

    #[test]
    fn issuers_are_the_last_intervals_deltas_without_the_vm_itself() {
        let mut f = Interfere::default();
        f.vms.insert(300, "db2".into());
        let dev = (254 << 20) | 16;
        let e = |tgid: u32, issued: u64, c: &str| {
            (
                rq_owner { dev, tgid },
                dev_user {
                    issued,
                    completed: issued,
                    bytes: issued * 4096,
                    comm: comm(c),
                },
            )
        };
        f.refresh_issuers([e(100, 50, "qemu"), e(42, 1000, "fio"), e(300, 10, "qemu")].into_iter());
        f.refresh_issuers([e(100, 80, "qemu"), e(42, 1090, "fio"), e(300, 20, "qemu")].into_iter());
        assert_eq!(
            f.neighbours(dev, 100),
            vec![
                "pid 42 fio 90 %".to_string(),
                "vm db2 (pid 300) 10 %".to_string()
            ]
        );
        let mut j = joined(&[("h.submit", 1), ("h.push", 2)]);
        j.interference = Some(Box::new(Interference {
            device: DeviceLoad {
                host_disk: Some("vdb (254:16)".into()),
                neighbour_issued: Some(5),
                ..Default::default()
            },
            ..Default::default()
        }));
        f.fill(&mut j);
        let i = j.interference.unwrap();
        assert_eq!(i.neighbours.len(), 2);
        assert_eq!(i.device.neighbour_issued, Some(5));
        assert_eq!(i.qemu_wait_ns, Some(0));
    }
}
