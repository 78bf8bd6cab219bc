//! Where the host's CPUs went over the workload window, thread by thread: each
//! thread of QEMU, the vsock backend and the host agent, with its run time and its
//! time spent runnable but waiting for a CPU (`/proc/PID/task/TID/schedstat`), and
//! how busy the host's CPUs were altogether (`/proc/stat`).
//!
//! Under TCG a vCPU thread is the guest's CPU: when it waits for a host CPU the guest
//! stands still while its clock runs on, and everything it measures gets slower. Its
//! wait share says whether a condition's cost came from the guest's own work or from
//! the host's threads crowding it out.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;

use serde::Serialize;

use crate::metrics::task_schedstats;

/// One thread at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadSample {
    pub role: &'static str,
    pub tid: u32,
    pub name: String,
    pub run_ns: u64,
    pub wait_ns: u64,
    pub slices: u64,
}

/// The host's CPU time counters (`/proc/stat`'s `cpu` line, ticks): (busy, all).
type CpuTicks = (u64, u64);

/// The watched threads and the host CPUs at one instant.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub threads: Vec<ThreadSample>,
    cpu: Option<CpuTicks>,
}

/// Parses `/proc/stat`'s aggregate `cpu` line into (busy, all) ticks; idle and
/// iowait are the idle part.
fn parse_cpu_line(stat: &str) -> Option<CpuTicks> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is
    // already in user.
    let all: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((all - idle, all))
}

/// Samples every thread of the given processes (role, pid) and the host CPUs. A
/// process or thread gone meanwhile is left out.
pub fn snapshot(procs: &[(&'static str, u32)]) -> Snapshot {
    let mut threads = Vec::new();
    for &(role, pid) in procs {
        for (tid, st) in task_schedstats(pid).unwrap_or_default() {
            let Some((run_ns, wait_ns, slices)) = st else {
                continue;
            };
            let name = fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                .map(|s| s.trim_end().to_string())
                .unwrap_or_default();
            threads.push(ThreadSample {
                role,
                tid,
                name,
                run_ns,
                wait_ns,
                slices,
            });
        }
    }
    let cpu = fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| parse_cpu_line(&s));
    Snapshot { threads, cpu }
}

/// The threads of one name in one process over the window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ThreadUse {
    pub role: &'static str,
    pub name: String,
    /// How many threads had this name (at either end of the window).
    pub threads: usize,
    pub run_secs: f64,
    pub wait_secs: f64,
    pub slices: u64,
}

/// The watched threads over the workload window.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HostThreads {
    pub window_secs: f64,
    pub threads: Vec<ThreadUse>,
    /// Share of all host CPUs' time that was busy (any process), when /proc/stat was read.
    pub host_busy_share: Option<f64>,
    /// Threads that ended within the window (their last part is not counted).
    pub ended: usize,
}

/// Whether a QEMU thread name is a vCPU's (`CPU 0/TCG`, `CPU 1/KVM`).
pub fn is_vcpu(name: &str) -> bool {
    name.starts_with("CPU ") && (name.ends_with("/TCG") || name.ends_with("/KVM"))
}

impl HostThreads {
    /// The difference of two snapshots `window_secs` apart. A thread born within the
    /// window counts from zero.
    pub fn between(a: &Snapshot, b: &Snapshot, window_secs: f64) -> HostThreads {
        let before: BTreeMap<(&str, u32), &ThreadSample> =
            a.threads.iter().map(|t| ((t.role, t.tid), t)).collect();
        let mut groups: BTreeMap<(&'static str, String), ThreadUse> = BTreeMap::new();
        for t in &b.threads {
            let (r0, w0, s0) = before
                .get(&(t.role, t.tid))
                .map_or((0, 0, 0), |p| (p.run_ns, p.wait_ns, p.slices));
            let g = groups
                .entry((t.role, t.name.clone()))
                .or_insert_with(|| ThreadUse {
                    role: t.role,
                    name: t.name.clone(),
                    threads: 0,
                    run_secs: 0.0,
                    wait_secs: 0.0,
                    slices: 0,
                });
            g.threads += 1;
            g.run_secs += t.run_ns.saturating_sub(r0) as f64 / 1e9;
            g.wait_secs += t.wait_ns.saturating_sub(w0) as f64 / 1e9;
            g.slices += t.slices.saturating_sub(s0);
        }
        let alive: std::collections::BTreeSet<(&str, u32)> =
            b.threads.iter().map(|t| (t.role, t.tid)).collect();
        let ended = a
            .threads
            .iter()
            .filter(|t| !alive.contains(&(t.role, t.tid)))
            .count();
        let host_busy_share = match (a.cpu, b.cpu) {
            (Some((b0, a0)), Some((b1, a1))) if a1 > a0 => {
                Some((b1.saturating_sub(b0)) as f64 / (a1 - a0) as f64)
            }
            _ => None,
        };
        let mut threads: Vec<ThreadUse> = groups.into_values().collect();
        threads.sort_by(|x, y| y.run_secs.total_cmp(&x.run_secs));
        HostThreads {
            window_secs,
            threads,
            host_busy_share,
            ended,
        }
    }

    /// The vCPU threads' time waiting for a host CPU, as a share of their time in the
    /// window (None without a vCPU thread).
    pub fn vcpu_wait_share(&self) -> Option<f64> {
        let v: Vec<&ThreadUse> = self
            .threads
            .iter()
            .filter(|t| t.role == "qemu" && is_vcpu(&t.name))
            .collect();
        let n: usize = v.iter().map(|t| t.threads).sum();
        (n > 0 && self.window_secs > 0.0)
            .then(|| v.iter().map(|t| t.wait_secs).sum::<f64>() / (self.window_secs * n as f64))
    }

    /// The table of `host-threads.txt`.
    pub fn text(&self) -> String {
        let mut s = format!(
            "host threads over the workload window ({:.2} s): CPU time, time runnable but \
             waiting for a CPU, time slices\n",
            self.window_secs
        );
        let _ = writeln!(
            s,
            "{:<14} {:<18} {:>3} {:>9} {:>7} {:>9} {:>7} {:>9}",
            "process", "thread", "n", "run s", "run %", "wait s", "wait %", "slices"
        );
        let pct = |x: f64| 100.0 * x / self.window_secs.max(1e-9);
        for t in &self.threads {
            let _ = writeln!(
                s,
                "{:<14} {:<18} {:>3} {:>9.3} {:>6.1}% {:>9.3} {:>6.1}% {:>9}",
                t.role,
                t.name,
                t.threads,
                t.run_secs,
                pct(t.run_secs),
                t.wait_secs,
                pct(t.wait_secs),
                t.slices
            );
        }
        if let Some(w) = self.vcpu_wait_share() {
            let _ = writeln!(
                s,
                "vCPU threads waited for a host CPU {:.1} % of the window",
                100.0 * w
            );
        }
        if let Some(b) = self.host_busy_share {
            let _ = writeln!(s, "host CPUs busy {:.1} % of the window", 100.0 * b);
        }
        if self.ended > 0 {
            let _ = writeln!(
                s,
                "{} thread(s) ended within the window (their last part is not counted)",
                self.ended
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(role: &'static str, tid: u32, name: &str, run: u64, wait: u64) -> ThreadSample {
        ThreadSample {
            role,
            tid,
            name: name.into(),
            run_ns: run,
            wait_ns: wait,
            slices: run / 1000,
        }
    }

    #[test]
    fn parses_proc_lines() {
        use crate::metrics::parse_schedstat;
        assert_eq!(parse_schedstat("123 45 6\n"), Some((123, 45, 6)));
        assert_eq!(parse_schedstat("123 x 6"), None);
        assert_eq!(parse_schedstat("1 2"), None);
        let stat = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        assert_eq!(parse_cpu_line(stat), Some((150, 1000)));
        assert_eq!(parse_cpu_line("intr 5\n"), None);
        assert!(is_vcpu("CPU 0/TCG") && is_vcpu("CPU 12/KVM"));
        assert!(!is_vcpu("worker") && !is_vcpu("CPU 0/TC"));
    }

    #[test]
    fn groups_threads_by_name_and_counts_born_and_ended_ones() {
        let a = Snapshot {
            threads: vec![
                t("qemu", 1, "CPU 0/TCG", 1_000_000_000, 100_000_000),
                t("qemu", 2, "worker", 0, 0),
                t("qemu", 3, "worker", 10, 0),
                t("backend", 9, "vhost-device-vs", 5, 5),
            ],
            cpu: Some((1000, 4000)),
        };
        let b = Snapshot {
            threads: vec![
                t("qemu", 1, "CPU 0/TCG", 2_800_000_000, 300_000_000),
                t("qemu", 2, "worker", 400_000_000, 1_000_000),
                // born within the window
                t("qemu", 4, "worker", 100_000_000, 0),
            ],
            cpu: Some((1900, 5000)),
        };
        let h = HostThreads::between(&a, &b, 2.0);
        assert_eq!(h.ended, 2);
        assert_eq!(h.host_busy_share, Some(0.9));
        let cpu = &h.threads[0];
        assert_eq!((cpu.name.as_str(), cpu.threads), ("CPU 0/TCG", 1));
        assert!((cpu.run_secs - 1.8).abs() < 1e-9 && (cpu.wait_secs - 0.2).abs() < 1e-9);
        let w = &h.threads[1];
        assert_eq!((w.name.as_str(), w.threads), ("worker", 2));
        assert!((w.run_secs - 0.5).abs() < 1e-9);
        assert!((h.vcpu_wait_share().unwrap() - 0.1).abs() < 1e-9);
        let text = h.text();
        assert!(text.contains("waited for a host CPU 10.0 %"), "{text}");
        assert!(text.contains("host CPUs busy 90.0 %"), "{text}");
        // No vCPU thread: no share.
        let none = HostThreads::between(&Snapshot::default(), &Snapshot::default(), 1.0);
        assert_eq!(none.vcpu_wait_share(), None);
    }

    #[test]
    fn reads_this_process() {
        if !std::path::Path::new("/proc/self/schedstat").exists() {
            return; // a kernel without schedstat: nothing to read
        }
        let me = std::process::id();
        let s = snapshot(&[("self", me), ("gone", u32::MAX)]);
        assert!(s.threads.iter().any(|t| t.tid == me && t.role == "self"));
        assert!(s.threads.iter().all(|t| t.role == "self"));
    }
}
