//! The bench's BPF accounting (`--bpf-stats`): a pass of its own after each measured
//! window, with `kernel.bpf_stats_enabled` on, and its reading.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use super::{fio_jobs, median, parse_fio, BenchResult, Costs, CONDITIONS, JOBS};
use crate::host_threads::HostThreads;

/// The BPF accounting pass, after the measured window: the jobs again with
/// `kernel.bpf_stats_enabled`, between two `bpftool prog show`. Accounting every program
/// run costs two clock reads per hook (the anchor has 2 per I/O, the guest agent up to 13):
/// the IOPS ratios come from the window before, where it is off.
pub(super) fn bpf_stats_pass(runtime: u32) -> String {
    let mut s = format!(
        "set -e\nbpf_sample() {{ {BPF_SAMPLE} }}\n\
         echo 1 >/proc/sys/kernel/bpf_stats_enabled\nbpf_sample start\n\
         # (the host's accounting is on once the lab has read the line above)\nsleep 1\n"
    );
    s += &fio_jobs(runtime, STATS_PREFIX, false);
    s += "bpf_sample end\necho 0 >/proc/sys/kernel/bpf_stats_enabled\n";
    s
}

/// The result files of the accounting pass's fio jobs: `fio-stats-<job>.json`.
pub(super) const STATS_PREFIX: &str = "fio-stats-";

/// Per-program BPF run time in the guest (`bpftool prog show` at the pass's ends), and a
/// console line (fd 3, see the guest's init.sh) for the lab to sample the host agent's.
const BPF_SAMPLE: &str = "if command -v bpftool >/dev/null; then \
bpftool prog show >/out/bpf-progs.$1.txt 2>/dev/null || true; fi\n\
{ echo \"VIOTRACE-HOST-BPF-SAMPLE $1\" >&3; } 2>/dev/null || true\n";

/// Parses `bpftool prog show`: program name → (run_time_ns, run_cnt).
pub fn parse_bpf_progs(text: &str) -> BTreeMap<String, (u64, u64)> {
    let mut m = BTreeMap::new();
    for line in text.lines() {
        let w: Vec<&str> = line.split_whitespace().collect();
        let field = |k: &str| {
            w.iter()
                .position(|x| *x == k)
                .and_then(|i| w.get(i + 1))
                .map(|v| v.to_string())
        };
        let (Some(name), Some(t), Some(c)) = (
            field("name"),
            field("run_time_ns").and_then(|v| v.parse::<u64>().ok()),
            field("run_cnt").and_then(|v| v.parse::<u64>().ok()),
        ) else {
            continue;
        };
        let e = m.entry(name).or_insert((0, 0));
        e.0 += t;
        e.1 += c;
    }
    m
}

/// Reads the BPF accounting pass of a run (see [`bpf_stats_pass`]): each program's run
/// time per I/O of that pass (the guest agent's, guest clock, when `guest`; the host
/// agent's, host clock, when `host`), and the pass's IOPS (kept apart from the measured
/// ones).
pub(super) fn bpf_accounting(
    dir: &Path,
    cond: &str,
    (guest, host): (bool, bool),
    res: &mut BenchResult,
) -> Result<(), String> {
    let rc = fs::read_to_string(dir.join("post.rc")).unwrap_or_default();
    if rc.trim() != "0" {
        let log = fs::read_to_string(dir.join("post.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        return Err(format!(
            "BPF accounting pass: rc {:?}: {}",
            rc.trim(),
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    let mut ios = 0u64;
    for j in JOBS {
        let f = dir.join(format!("{STATS_PREFIX}{}.json", j.name));
        let (iops, _, _, n) = parse_fio(&f).map_err(|e| format!("{e:#}"))?;
        ios += n;
        let s = res.jobs.entry(cond.into()).or_default();
        s.entry(j.name.into())
            .or_default()
            .iops_bpf_stats
            .push(iops);
    }
    let c = res.costs.entry(cond.into()).or_default();
    if guest {
        let (total, progs) = per_io(dir, "bpf-progs", ios)?;
        c.guest_bpf_ns_per_io.push(total);
        for (name, ns) in progs {
            c.guest_bpf_programs.entry(name).or_default().push(ns);
        }
    }
    if host {
        let (total, progs) = per_io(dir, "host-bpf-progs", ios)?;
        c.host_bpf_ns_per_io.push(total);
        for (name, ns) in progs {
            c.host_bpf_programs.entry(name).or_default().push(ns);
        }
    }
    Ok(())
}

/// `<stem>.start.txt` and `<stem>.end.txt`: the run time per I/O of all programs and of
/// each that ran. A sample that could not be taken left `<stem>.<label>.err`.
fn per_io(dir: &Path, stem: &str, ios: u64) -> Result<(f64, BTreeMap<String, f64>), String> {
    let progs = |w: &str| {
        if let Ok(why) = fs::read_to_string(dir.join(format!("{stem}.{w}.err"))) {
            return Err(format!("{stem}.{w}: {}", why.trim()));
        }
        fs::read_to_string(dir.join(format!("{stem}.{w}.txt")))
            .map(|t| parse_bpf_progs(&t))
            .map_err(|e| format!("{stem}.{w}.txt: {e}"))
    };
    let (a, b) = (progs("start")?, progs("end")?);
    let mut total = 0.0;
    let mut each = BTreeMap::new();
    for (name, (t1, _)) in &b {
        let t0 = a.get(name).map_or(0, |x| x.0);
        let ns = t1.saturating_sub(t0) as f64 / ios.max(1) as f64;
        if ns > 0.0 {
            total += ns;
            each.insert(name.clone(), ns);
        }
    }
    Ok((total, each))
}

/// The per-program tables of the accounting passes, guest's and host's, per condition.
pub(super) fn render_bpf_costs(res: &BenchResult) -> String {
    let mut s = String::new();
    let base = res.jobs.get("none");
    for &name in CONDITIONS {
        let Some(c) = res.costs.get(name) else {
            continue;
        };
        if c.guest_bpf_ns_per_io.is_empty() && c.host_bpf_ns_per_io.is_empty() {
            continue;
        }
        // What the accounting itself costs: that pass's IOPS against the untraced runs'.
        let pass: Vec<String> = JOBS
            .iter()
            .filter_map(|j| {
                let x = median(&res.jobs.get(name)?.get(j.name)?.iops_bpf_stats);
                let b = median(&base?.get(j.name)?.iops);
                Some(format!("{} {:.3}", j.name, x / b))
            })
            .collect();
        let _ = writeln!(s, "\n{name}: BPF accounting pass");
        if !pass.is_empty() {
            let _ = writeln!(
                s,
                "  (IOPS ratio during that pass, accounting on: {})",
                pass.join(", ")
            );
        }
        let sides = [
            (
                "guest",
                "guest clock",
                &c.guest_bpf_ns_per_io,
                &c.guest_bpf_programs,
            ),
            (
                "host",
                "host clock, the host agent's programs",
                &c.host_bpf_ns_per_io,
                &c.host_bpf_programs,
            ),
        ];
        for (side, clock, total, progs) in sides {
            if total.is_empty() {
                continue;
            }
            let _ = writeln!(
                s,
                "  {side} BPF run time {:.0} ns per I/O ({clock}), by program:",
                median(total)
            );
            let mut progs: Vec<(&String, f64)> =
                progs.iter().map(|(p, v)| (p, median(v))).collect();
            progs.sort_by(|a, b| b.1.total_cmp(&a.1));
            for (p, ns) in progs {
                let _ = writeln!(s, "    {p:<24} {ns:>8.0} ns/IO");
            }
        }
    }
    s
}

/// One round's host threads into the condition's costs.
pub(super) fn note_host_threads(c: &mut Costs, h: &HostThreads) {
    if let Some(w) = h.vcpu_wait_share() {
        c.vcpu_wait_share.push(w);
    }
    if let Some(b) = h.host_busy_share {
        c.host_busy_share.push(b);
    }
    if h.window_secs > 0.0 {
        for t in &h.threads {
            c.host_thread_run_share
                .entry(format!("{}/{}", t.role, t.name))
                .or_default()
                .push(t.run_secs / h.window_secs);
        }
    }
}

/// The host CPUs per condition (medians over rounds): how long the vCPU thread waited
/// for a CPU, how busy the host was, and the busiest host threads besides the vCPU.
pub(super) fn render_host_threads(res: &BenchResult) -> String {
    let mut s = String::new();
    for &name in CONDITIONS {
        let Some(c) = res.costs.get(name) else {
            continue;
        };
        if c.vcpu_wait_share.is_empty() && c.host_busy_share.is_empty() {
            continue;
        }
        if s.is_empty() {
            s +=
                "\nhost CPUs over the window (medians): vCPU thread waiting for a CPU, host busy, \
                  the busiest other host threads (% of one CPU)\n";
        }
        let pct = |v: &Vec<f64>| {
            if v.is_empty() {
                "-".to_string()
            } else {
                format!("{:.1} %", 100.0 * median(v))
            }
        };
        let mut others: Vec<(f64, &String)> = c
            .host_thread_run_share
            .iter()
            .filter(|(k, _)| !k.starts_with("qemu/CPU "))
            .map(|(k, v)| (median(v), k))
            // (idle threads, below 0.1 % of a CPU, are left out)
            .filter(|(v, _)| *v >= 0.001)
            .collect();
        others.sort_by(|a, b| b.0.total_cmp(&a.0));
        let top: Vec<String> = others
            .iter()
            .take(4)
            .map(|(v, k)| format!("{k} {:.1}", 100.0 * v))
            .collect();
        let _ = writeln!(
            s,
            "{name:<8} vCPU wait {:>7}  host busy {:>7}  {}",
            pct(&c.vcpu_wait_share),
            pct(&c.host_busy_share),
            top.join(", ")
        );
    }
    s
}
