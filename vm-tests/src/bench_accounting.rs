//! The bench's BPF accounting (`--bpf-stats`): a pass of its own after each measured
//! window, with `kernel.bpf_stats_enabled` on, and its reading.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use super::{fio_jobs, parse_fio, BenchResult, JOBS};

/// The BPF accounting pass, after the measured window: the jobs again with
/// `kernel.bpf_stats_enabled`, between two `bpftool prog show`. Accounting every program
/// run costs two clock reads per hook (the anchor has 2 per I/O, the guest agent up to 13):
/// the IOPS ratios come from the window before, where it is off.
pub(super) fn bpf_stats_pass(runtime: u32) -> String {
    let mut s = format!(
        "set -e\nbpf_sample() {{ {BPF_SAMPLE} }}\n\
         echo 1 >/proc/sys/kernel/bpf_stats_enabled\nbpf_sample start\n"
    );
    s += &fio_jobs(runtime, STATS_PREFIX);
    s += "bpf_sample end\necho 0 >/proc/sys/kernel/bpf_stats_enabled\n";
    s
}

/// The result files of the accounting pass's fio jobs: `fio-stats-<job>.json`.
pub(super) const STATS_PREFIX: &str = "fio-stats-";

/// Per-program BPF run time in the guest (`bpftool prog show` at the pass's ends).
const BPF_SAMPLE: &str = "if command -v bpftool >/dev/null; then \
bpftool prog show >/out/bpf-progs.$1.txt 2>/dev/null || true; fi\n";

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
/// time per I/O of that pass, and the pass's IOPS (kept apart from the measured ones).
pub(super) fn bpf_accounting(dir: &Path, cond: &str, res: &mut BenchResult) -> Result<(), String> {
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
    let progs = |w: &str| {
        fs::read_to_string(dir.join(format!("bpf-progs.{w}.txt")))
            .map(|t| parse_bpf_progs(&t))
            .map_err(|e| format!("bpf-progs.{w}.txt: {e}"))
    };
    let (a, b) = (progs("start")?, progs("end")?);
    let c = res.costs.entry(cond.into()).or_default();
    let mut total = 0.0;
    for (name, (t1, _)) in &b {
        let t0 = a.get(name).map_or(0, |x| x.0);
        let per_io = t1.saturating_sub(t0) as f64 / ios.max(1) as f64;
        if per_io > 0.0 {
            total += per_io;
            c.guest_bpf_programs
                .entry(name.clone())
                .or_default()
                .push(per_io);
        }
    }
    c.guest_bpf_ns_per_io.push(total);
    Ok(())
}
