//! CPU time and memory of processes over the workload window, from `/proc/PID/stat`
//! and `/proc/PID/status` (read live on the host, or shipped from the guest).
//!
//! `stat` counts CPU time in ticks of 10 ms: over a 20 s bench run an agent's
//! 0.1 s is known to ±20 %. A live process is therefore also read thread by
//! thread (`/proc/PID/task/TID/schedstat`, ns); when it had the same threads
//! at both ends of the window that sum is the window's CPU time (a thread that
//! ended within the window would take its time with it: then the ticks count).

use std::fs;
use std::path::Path;

use serde::Serialize;

/// USER_HZ: the unit of utime/stime in /proc/PID/stat (100 on every Linux x86 ABI).
const USER_HZ: f64 = 100.0;

/// One sample of a process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ProcSample {
    /// utime + stime, seconds.
    pub cpu_secs: f64,
    /// utime alone, seconds (ticks, as `cpu_secs`).
    pub user_secs: f64,
    /// Peak resident set size (VmHWM), KiB.
    pub peak_rss_kib: u64,
    /// Resident set size now (VmRSS), KiB.
    pub rss_kib: u64,
    /// The threads' run time (ns) and a digest of their ids, when read live.
    #[serde(skip)]
    pub threads: Option<(u64, u64)>,
}

/// A thread's schedstat line: run time (ns), time runnable but waiting (ns), time slices.
pub(crate) type Schedstat = (u64, u64, u64);

/// Parses `/proc/PID/task/TID/schedstat`.
pub(crate) fn parse_schedstat(s: &str) -> Option<Schedstat> {
    let mut f = s.split_whitespace().map(|x| x.parse::<u64>().ok());
    Some((f.next()??, f.next()??, f.next()??))
}

/// Every thread of a live process with its schedstat: None for a thread that ended
/// while the list was read. None when the process's task list cannot be read.
pub(crate) fn task_schedstats(pid: u32) -> Option<Vec<(u32, Option<Schedstat>)>> {
    let mut v = Vec::new();
    for e in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
            continue;
        };
        let st = fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat"))
            .ok()
            .and_then(|s| parse_schedstat(&s));
        v.push((tid, st));
    }
    Some(v)
}

/// The sum of the run times (ns) of a live process's threads and a digest of
/// their ids. A thread that ends while the list is read still counts in the
/// digest (so that this sample matches no other and the ticks count); None
/// when no thread's time could be read (a kernel without schedstat).
fn thread_times(pid: u32) -> Option<(u64, u64)> {
    let mut sum = 0u64;
    let mut read_any = false;
    let mut ids: Vec<u64> = Vec::new();
    for (tid, st) in task_schedstats(pid)? {
        ids.push(u64::from(tid));
        match st {
            Some((run_ns, _, _)) => {
                sum += run_ns;
                read_any = true;
            }
            // Gone meanwhile: a digest no later sample can have.
            None => ids.push(u64::MAX),
        }
    }
    if !read_any {
        return None;
    }
    ids.sort_unstable();
    let digest = ids.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ t).wrapping_mul(0x100_0000_01b3)
    });
    Some((sum, digest))
}

fn status_kib(status: &str, key: &str) -> u64 {
    viotrace_shared::selfcost::proc_kib(status, key).unwrap_or(0)
}

impl ProcSample {
    /// Parses the text of /proc/PID/stat and /proc/PID/status.
    pub fn parse(stat: &str, status: &str) -> Option<ProcSample> {
        // The comm field may contain spaces and parentheses: fields start after the last ')'.
        let rest = &stat[stat.rfind(')')? + 1..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // rest[0] is field 3 (state); utime is field 14, stime field 15.
        let utime: u64 = f.get(11)?.parse().ok()?;
        let stime: u64 = f.get(12)?.parse().ok()?;
        Some(ProcSample {
            cpu_secs: (utime + stime) as f64 / USER_HZ,
            user_secs: utime as f64 / USER_HZ,
            peak_rss_kib: status_kib(status, "VmHWM:"),
            rss_kib: status_kib(status, "VmRSS:"),
            threads: None,
        })
    }

    /// Samples a live process.
    pub fn of_pid(pid: u32) -> Option<ProcSample> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let mut s = Self::parse(&stat, &status)?;
        s.threads = thread_times(pid);
        Some(s)
    }

    /// Reads a sample the guest shipped as `<prefix>.stat` / `<prefix>.status`
    /// (and `<prefix>.smaps_rollup`, see [`ProcSample::with_rollup`]).
    pub fn from_files(dir: &Path, prefix: &str) -> Option<ProcSample> {
        let stat = fs::read_to_string(dir.join(format!("{prefix}.stat"))).ok()?;
        let status = fs::read_to_string(dir.join(format!("{prefix}.status"))).ok()?;
        let rollup = fs::read_to_string(dir.join(format!("{prefix}.smaps_rollup")));
        let s = Self::parse(&stat, &status)?;
        Some(match rollup {
            Ok(r) => s.with_rollup(&r),
            Err(_) => s,
        })
    }

    /// The RSS counted from the page tables (`smaps_rollup`) where it is higher
    /// than the status counters: before 6.2 those lag by what each thread has
    /// mapped since its last 64 faults (on the 6.1 guest, the agent's 2 MiB ring
    /// buffer until its exit), so its VmRSS and VmHWM read low.
    pub fn with_rollup(mut self, rollup: &str) -> ProcSample {
        if let Some(kib) = viotrace_shared::selfcost::rollup_rss_kib(rollup) {
            self.rss_kib = self.rss_kib.max(kib);
            self.peak_rss_kib = self.peak_rss_kib.max(kib);
        }
        self
    }
}

/// A process's usage over the workload window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Usage {
    /// CPU seconds spent between the workload's start and end.
    pub cpu_secs: f64,
    /// The share of it spent in userspace, from the ticks' split of utime and
    /// stime over the window (the thread run times have no split): None
    /// without a tick in the window.
    pub user_share: Option<f64>,
    /// Peak RSS at the end of the workload, KiB.
    pub peak_rss_kib: u64,
    /// RSS at the end of the workload (the steady state), KiB.
    pub rss_kib: u64,
}

impl Usage {
    pub fn between(start: Option<ProcSample>, end: Option<ProcSample>) -> Option<Usage> {
        let (s, e) = (start?, end?);
        let cpu_secs = match (s.threads, e.threads) {
            (Some((a, ta)), Some((b, tb))) if ta == tb && b >= a => (b - a) as f64 / 1e9,
            _ => (e.cpu_secs - s.cpu_secs).max(0.0),
        };
        let ticks = e.cpu_secs - s.cpu_secs;
        let user_share =
            (ticks > 0.0).then(|| ((e.user_secs - s.user_secs) / ticks).clamp(0.0, 1.0));
        Some(Usage {
            cpu_secs,
            user_share,
            peak_rss_kib: e.peak_rss_kib,
            rss_kib: e.rss_kib,
        })
    }
}

/// Usage of QEMU and the agents over the workload window.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RunMetrics {
    pub qemu: Option<Usage>,
    pub host_agent: Option<Usage>,
    /// The host agent's samples by mode over the window (`sample_host_cpu`).
    pub host_agent_split: Option<crate::cpu_split::Split>,
    pub guest_agent: Option<Usage>,
    /// The host's threads (QEMU's, the vsock backend's, the host agent's) over the window.
    pub host_threads: Option<crate::host_threads::HostThreads>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 5 1000 200";
        let status = "Name:\tx\nVmHWM:\t   5120 kB\nVmRSS:\t 4000 kB\n";
        let s = ProcSample::parse(stat, status).unwrap();
        assert_eq!(s.cpu_secs, 3.0);
        assert_eq!(s.user_secs, 2.5);
        assert_eq!(s.threads, None);
        assert_eq!((s.peak_rss_kib, s.rss_kib), (5120, 4000));
        assert!(ProcSample::parse("garbage", "").is_none());
    }

    /// Before 6.2 the status counters lag behind the page tables (seen on the
    /// 6.1 guest: VmRSS 4 052 KiB while smaps_rollup counted 6 240): the
    /// rollup's RSS raises both figures, and never lowers them.
    #[test]
    fn the_page_tables_rss_raises_lagging_status_counters() {
        let stat = "42 (a) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 5 1000 200";
        let status = "Name:\ta\nVmHWM:\t   5544 kB\nVmRSS:\t 4052 kB\n";
        let rollup = "55d0-7ffd ---p 00000000 00:00 0  [rollup]\nRss:  6240 kB\nPss:  5000 kB\n";
        let s = ProcSample::parse(stat, status).unwrap().with_rollup(rollup);
        assert_eq!((s.peak_rss_kib, s.rss_kib), (6240, 6240));
        let low = "Rss:  3000 kB\n";
        let s = ProcSample::parse(stat, status).unwrap().with_rollup(low);
        assert_eq!((s.peak_rss_kib, s.rss_kib), (5544, 4052));
        let s = ProcSample::parse(stat, status)
            .unwrap()
            .with_rollup("garbage");
        assert_eq!((s.peak_rss_kib, s.rss_kib), (5544, 4052));
    }

    #[test]
    fn usage_is_a_difference() {
        let a = ProcSample {
            cpu_secs: 1.0,
            user_secs: 0.8,
            peak_rss_kib: 10,
            rss_kib: 9,
            threads: None,
        };
        let b = ProcSample {
            cpu_secs: 1.5,
            user_secs: 1.2,
            peak_rss_kib: 12,
            rss_kib: 7,
            threads: None,
        };
        let u = Usage::between(Some(a), Some(b)).unwrap();
        assert_eq!(u.cpu_secs, 0.5);
        // 0.4 of the 0.5 s in userspace
        assert!((u.user_share.unwrap() - 0.8).abs() < 1e-9);
        assert_eq!(
            Usage::between(Some(a), Some(a)).unwrap().user_share,
            None,
            "no tick: no split"
        );
        assert_eq!((u.peak_rss_kib, u.rss_kib), (12, 7));
        assert!(Usage::between(None, Some(b)).is_none());
        // Thread times, when both ends saw the same threads; else the ticks.
        let (a2, b2) = (
            ProcSample {
                threads: Some((1_000_000_000, 7)),
                ..a
            },
            ProcSample {
                threads: Some((1_123_456_789, 7)),
                ..b
            },
        );
        let u = Usage::between(Some(a2), Some(b2)).unwrap();
        assert!((u.cpu_secs - 0.123456789).abs() < 1e-12, "{}", u.cpu_secs);
        let b3 = ProcSample {
            threads: Some((1_123_456_789, 8)),
            ..b
        };
        assert_eq!(Usage::between(Some(a2), Some(b3)).unwrap().cpu_secs, 0.5);
    }

    #[test]
    fn threads_ending_while_read_do_not_lose_the_sample() {
        if !Path::new("/proc/self/schedstat").exists() {
            return; // Nothing to read thread by thread (the test above checks the None).
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churn = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::spawn(|| ()).join().unwrap();
                }
            })
        };
        let me = std::process::id();
        let samples: Vec<_> = (0..300).map(|_| ProcSample::of_pid(me)).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        churn.join().unwrap();
        for s in samples {
            assert!(s.expect("own sample").threads.is_some());
        }
    }

    #[test]
    fn a_live_process_is_read_thread_by_thread() {
        let me = std::process::id();
        let s0 = ProcSample::of_pid(me).expect("own sample");
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let s1 = ProcSample::of_pid(me).expect("own sample");
        if !Path::new("/proc/self/schedstat").exists() {
            // A kernel without CONFIG_SCHED_INFO: no thread times, the ticks count.
            assert_eq!((s0.threads, s1.threads), (None, None));
            return;
        }
        let (a, b) = (s0.threads.expect("threads"), s1.threads.expect("threads"));
        // (Other tests' threads may come and go meanwhile: then the digest differs.)
        assert!(a.1 != b.1 || b.0 - a.0 >= 25_000_000, "{a:?} {b:?}");
    }
}
