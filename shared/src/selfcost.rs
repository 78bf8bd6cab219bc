//! An agent's own cost while it traces: its CPU time (every thread, user and
//! system, from `getrusage`), its peak RSS, and its BPF programs' run time when
//! the kernel measures it (`sysctl kernel.bpf_stats_enabled=1`), each per I/O
//! traced. The agents print it with their totals and put it in their final
//! counters, so whoever leaves an agent on sees what it costs on that machine.

use std::time::{Duration, Instant};

use nix::sys::resource::{getrusage, UsageWho};
use nix::sys::time::TimeVal;

/// The process's CPU time so far (user + system, every thread) and its peak
/// RSS in KiB ([`peak_rss_kib`]).
pub fn usage() -> Option<(Duration, u64)> {
    Some((cpu_time()?, peak_rss_kib()))
}

/// The process's CPU time so far (user + system, every thread). The kernel
/// keeps the sum exact (the run time of the threads); only its split into user
/// and system time is estimated.
pub fn cpu_time() -> Option<Duration> {
    let u = getrusage(UsageWho::RUSAGE_SELF).ok()?;
    let d = |t: TimeVal| {
        Duration::from_secs(t.tv_sec().max(0) as u64)
            + Duration::from_micros(t.tv_usec().max(0) as u64)
    };
    Some(d(u.user_time()) + d(u.system_time()))
}

/// The process's peak RSS in KiB: the kernel's high-water mark, or the RSS now
/// counted from the page tables if that is higher: before 6.2 a thread's page
/// counts reach the process's only every 64 faults or at its exit (a 2 MiB ring
/// buffer mapped by the main thread stayed out of VmRSS and VmHWM until then on
/// 6.1). Walks the page tables: for reports, not for every metrics scrape.
pub fn peak_rss_kib() -> u64 {
    let hwm = getrusage(UsageWho::RUSAGE_SELF).map_or(0, |u| u.max_rss().max(0) as u64);
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok();
    let mapped = rollup.as_deref().and_then(rollup_rss_kib).unwrap_or(0);
    hwm.max(mapped)
}

/// The `Rss:` of a `/proc/PID/smaps_rollup` text, KiB: resident pages counted
/// from the page tables (exact on every kernel, unlike `VmRSS`).
pub fn rollup_rss_kib(rollup: &str) -> Option<u64> {
    proc_kib(rollup, "Rss:")
}

/// The value of the `key` line (e.g. `VmHWM:`) of a /proc text in `kB`.
pub fn proc_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The kernel's run-time counters of an agent's BPF programs, summed: both stay
/// 0 while the kernel does not measure them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BpfRuns {
    pub ns: u64,
    pub runs: u64,
}

/// The cost from the moment tracing started.
#[derive(Clone, Copy, Debug)]
pub struct SelfCost {
    cpu0: Duration,
    t0: Instant,
    bpf0: BpfRuns,
}

/// An agent's cost over a span of its tracing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostReport {
    pub cpu: Duration,
    pub wall: Duration,
    pub peak_rss_kib: u64,
    /// BPF run time over the span; None when the kernel did not measure it.
    pub bpf_ns: Option<u64>,
    /// I/Os traced over the span (the unit of the per-I/O figures).
    pub ios: u64,
}

impl SelfCost {
    /// Starts measuring now; `bpf`: the programs' counters now.
    pub fn start(bpf: BpfRuns) -> Self {
        SelfCost {
            cpu0: cpu_time().unwrap_or_default(),
            t0: Instant::now(),
            bpf0: bpf,
        }
    }

    /// The cost since [`start`](Self::start), `ios` I/Os traced, the programs'
    /// counters now `bpf` (None: not read, e.g. for a live metric, where reading
    /// every program's info each time would cost more than it tells).
    pub fn report(&self, bpf: Option<BpfRuns>, ios: u64) -> CostReport {
        let (cpu, peak) = usage().unwrap_or_default();
        CostReport {
            cpu: cpu.saturating_sub(self.cpu0),
            wall: self.t0.elapsed(),
            peak_rss_kib: peak,
            bpf_ns: bpf.and_then(|b| measured(self.bpf0, b)),
            ios,
        }
    }
}

/// BPF run time between two readings, if the kernel measured runs in between.
fn measured(before: BpfRuns, after: BpfRuns) -> Option<u64> {
    let runs = after.runs.saturating_sub(before.runs);
    let ns = after.ns.saturating_sub(before.ns);
    (runs > 0 && ns > 0).then_some(ns)
}

impl CostReport {
    /// One line for the totals: `unit` names the I/O (`request`).
    pub fn line(&self, unit: &str) -> String {
        let per = |ns: f64| {
            if self.ios == 0 {
                "-".to_string()
            } else {
                format!("{:.2} µs", ns / 1e3 / self.ios as f64)
            }
        };
        let wall = self.wall.as_secs_f64();
        let share = if wall > 0.0 {
            100.0 * self.cpu.as_secs_f64() / wall
        } else {
            0.0
        };
        let mut s = format!(
            "cost while tracing: {:.2} s CPU in {wall:.1} s ({share:.1} % of a CPU), {} per {unit} ({} {unit}s), peak RSS {:.1} MiB",
            self.cpu.as_secs_f64(),
            per(self.cpu.as_nanos() as f64),
            self.ios,
            self.peak_rss_kib as f64 / 1024.0
        );
        match self.bpf_ns {
            Some(ns) => s += &format!(", BPF run time {} per {unit}", per(ns as f64)),
            None => {
                s += "; BPF run time not measured (sysctl kernel.bpf_stats_enabled=1 measures it)"
            }
        }
        s
    }

    /// The final counters: CPU µs, peak RSS KiB, and BPF ns when measured.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let mut v = vec![
            (
                "cost_cpu_us",
                self.cpu.as_micros().min(u128::from(u64::MAX)) as u64,
            ),
            ("cost_peak_rss_kib", self.peak_rss_kib),
        ];
        if let Some(ns) = self.bpf_ns {
            v.push(("cost_bpf_ns", ns));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_this_process_cpu() {
        let (a, peak) = usage().unwrap();
        // Burn some CPU: the sum must grow by about as much.
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let (b, _) = usage().unwrap();
        assert!(b - a >= Duration::from_millis(20), "{a:?} → {b:?}");
        assert!(peak > 1024, "peak RSS {peak} KiB");
    }

    #[test]
    fn bpf_time_only_when_the_kernel_measured_runs() {
        let z = BpfRuns::default();
        assert_eq!(measured(z, z), None);
        assert_eq!(measured(z, BpfRuns { ns: 0, runs: 10 }), None);
        assert_eq!(
            measured(BpfRuns { ns: 5, runs: 1 }, BpfRuns { ns: 105, runs: 3 }),
            Some(100)
        );
    }

    #[test]
    fn the_line_and_counters_give_per_io_figures() {
        let r = CostReport {
            cpu: Duration::from_millis(480),
            wall: Duration::from_secs(60),
            peak_rss_kib: 8000,
            bpf_ns: Some(1_980_000_000),
            ios: 184_000,
        };
        let l = r.line("request");
        assert!(l.contains("0.48 s CPU in 60.0 s (0.8 % of a CPU)"), "{l}");
        assert!(l.contains("2.61 µs per request (184000 requests)"), "{l}");
        assert!(l.contains("peak RSS 7.8 MiB"), "{l}");
        assert!(l.contains("BPF run time 10.76 µs per request"), "{l}");
        assert_eq!(
            r.counters(),
            vec![
                ("cost_cpu_us", 480_000),
                ("cost_peak_rss_kib", 8000),
                ("cost_bpf_ns", 1_980_000_000)
            ]
        );
        let n = CostReport {
            bpf_ns: None,
            ios: 0,
            ..r
        };
        assert!(n.line("request").contains("- per request"));
        assert!(n.line("request").contains("not measured"));
        assert_eq!(n.counters().len(), 2);
    }
}
