//! The compatibility table: what lab runs proved, per guest kernel × QEMU build × attach mode.
//!
//! Reads the run directories that [`crate::Lab::run`] leaves (`summary.json`/`summary.txt`,
//! `guest.jsonl`/`guest.log`, `host.jsonl`/`host.log`, `joined.jsonl`) and renders a Markdown
//! table of the facts found there. Nothing is inferred from directory names: a run whose guest
//! kernel or QEMU version is not recorded is skipped and reported as such.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, Result};

pub use run::{read_run, requested_mode};

/// What one lab run proved.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunFacts {
    pub dir: PathBuf,
    /// The guest kernel release that booted (`uname -r`).
    pub kernel: String,
    /// The QEMU version that ran (`x.y.z`).
    pub qemu: String,
    /// The lab's name for that build (`--qemu 7.2|10.0|11.x|PATH`), when recorded.
    pub qemu_build: Option<String>,
    /// The host's kernel release, when recorded (runs since 2026-12-04).
    pub host_kernel: Option<String>,
    /// An agent ran (a run with `agents: None` only boots the guest).
    pub agents: bool,
    /// The workload exited 0 and the lab did not record a failure.
    pub workload_ok: bool,
    /// The guest agent ran, exited 0 and reported its final statistics.
    pub guest: Option<GuestFacts>,
    /// `host_elem` records of a host agent that exited 0 (0: no host agent, or it traced nothing).
    pub host_elems: u64,
    /// Guest `vdb` requests that have a joined record, and all guest `vdb` requests (runs with
    /// a guest↔host link and a joined.jsonl only).
    pub joined: Option<(u64, u64)>,
    /// The host's per-VM transport accounting: (all balanced, records lost in transit).
    pub transport: Option<(bool, u64)>,
    /// The guest's uplink line ends with `(balanced)`.
    pub uplink_balanced: Option<bool>,
    /// When the run finished (mtime of its summary).
    pub finished: Option<SystemTime>,
}

/// The guest agent's attach mode and what it could not see.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GuestFacts {
    /// The mode asked for (`--mode X` in the guest arguments; `auto` without one).
    pub requested: String,
    /// The mode the agent attached in (`fentry`, `kprobe`, `tracepoint`).
    pub attached: String,
    pub blind_points: Vec<String>,
}

/// A directory that holds lab output but could not be used, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Skipped {
    pub dir: PathBuf,
    pub reason: String,
}

/// Finds run directories (those with a `summary.txt`) in `roots` and up to two levels below.
pub fn scan(roots: &[PathBuf]) -> Result<(Vec<RunFacts>, Vec<Skipped>)> {
    let mut dirs = Vec::new();
    for root in roots {
        anyhow::ensure!(root.is_dir(), "{} is not a directory", root.display());
        collect_run_dirs(root, 2, &mut dirs)?;
    }
    dirs.sort();
    let (mut runs, mut skipped) = (Vec::new(), Vec::new());
    for d in dirs {
        match read_run(&d) {
            Ok(r) => runs.push(r),
            Err(e) => skipped.push(Skipped {
                dir: d,
                reason: format!("{e:#}"),
            }),
        }
    }
    Ok((runs, skipped))
}

fn collect_run_dirs(dir: &Path, depth: u32, out: &mut Vec<PathBuf>) -> Result<()> {
    if dir.join("summary.txt").is_file() {
        out.push(dir.to_path_buf());
        return Ok(());
    }
    if depth == 0 {
        return Ok(());
    }
    for e in fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            collect_run_dirs(&p, depth - 1, out)?;
        }
    }
    Ok(())
}

/// Sorts version strings by their numeric parts (`5.10…` < `6.1…` < `6.12…` < `7.2…`).
fn version_key(v: &str) -> Vec<u64> {
    v.split(|c: char| !c.is_ascii_digit())
        .take_while(|p| !p.is_empty())
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn sorted_versions(set: BTreeSet<&str>) -> Vec<&str> {
    let mut v: Vec<_> = set.into_iter().collect();
    v.sort_by_key(|s| (version_key(s), s.to_string()));
    v
}

/// The joined ratio: of the one run, or the range over the runs and the newest run's figure.
fn joined_cell(ok: &[&&RunFacts]) -> Option<String> {
    let mut runs: Vec<_> = ok
        .iter()
        .filter_map(|r| Some((r.finished, r.joined?)))
        .collect();
    runs.sort_by_key(|r| r.0);
    let pct = |(j, g): (u64, u64)| j * 100 / g;
    let (_, newest) = *runs.last()?;
    let lo = runs.iter().map(|r| pct(r.1)).min()?;
    let hi = runs.iter().map(|r| pct(r.1)).max()?;
    let (j, g) = newest;
    Some(if lo == hi {
        format!(
            "joined {lo} % ({j}/{g}{})",
            if runs.len() > 1 {
                format!(", {} runs", runs.len())
            } else {
                String::new()
            }
        )
    } else {
        format!(
            "joined {lo}–{hi} % over {} runs (newest {} %, {j}/{g})",
            runs.len(),
            pct(newest)
        )
    })
}

/// One cell of the table: what the successful runs on one kernel × QEMU proved.
fn cell(runs: &[&RunFacts]) -> String {
    let ok: Vec<_> = runs.iter().filter(|r| r.workload_ok).collect();
    // A failed run without agents (a lab test of the exit status) says nothing about viotrace.
    let failed = runs.iter().filter(|r| !r.workload_ok && r.agents).count();
    let mut parts = Vec::new();
    let mut modes: BTreeMap<&str, BTreeSet<(&str, Vec<String>)>> = BTreeMap::new();
    for g in ok.iter().filter_map(|r| r.guest.as_ref()) {
        modes
            .entry(&g.requested)
            .or_default()
            .insert((&g.attached, g.blind_points.clone()));
    }
    for (req, got) in &modes {
        for (attached, blind) in got {
            let mut s = if req == attached {
                format!("{req} ✓")
            } else {
                format!("{req}→{attached} ✓")
            };
            if !blind.is_empty() {
                s += &format!(" (blind: {})", blind.join(" "));
            }
            parts.push(s);
        }
    }
    let host_runs = ok.iter().filter(|r| r.host_elems > 0).count();
    if host_runs > 0 {
        parts.push(format!("host ✓ ({host_runs} run(s))"));
    }
    if let Some(j) = joined_cell(&ok) {
        parts.push(j);
    }
    let transports: Vec<_> = ok.iter().filter_map(|r| r.transport).collect();
    if !transports.is_empty() {
        let lost: u64 = transports.iter().map(|t| t.1).sum();
        let unbalanced = transports.iter().filter(|t| !t.0).count();
        parts.push(if unbalanced == 0 {
            format!("{lost} lost, transport balanced")
        } else {
            format!("{lost} lost, transport NOT balanced in {unbalanced} run(s)")
        });
    }
    let bad_uplinks = ok
        .iter()
        .filter(|r| r.uplink_balanced == Some(false))
        .count();
    if bad_uplinks > 0 {
        parts.push(format!("guest uplink NOT balanced in {bad_uplinks} run(s)"));
    }
    if parts.is_empty() {
        parts.push(if ok.is_empty() {
            "no successful run".to_string()
        } else {
            "boots (no agent result)".to_string()
        });
    }
    if failed > 0 {
        parts.push(format!("{failed} run(s) failed"));
    }
    parts.join(" · ")
}

/// The Markdown table: rows = guest kernels, columns = QEMU versions, "not run" where no run
/// exists, followed by a line saying which runs it is made of.
pub fn render(runs: &[RunFacts], skipped: &[Skipped]) -> String {
    let kernels = sorted_versions(runs.iter().map(|r| r.kernel.as_str()).collect());
    let qemus = sorted_versions(runs.iter().map(|r| r.qemu.as_str()).collect());
    let mut out = String::from("| guest kernel |");
    for q in &qemus {
        let builds: BTreeSet<_> = runs
            .iter()
            .filter(|r| r.qemu == *q)
            .filter_map(|r| r.qemu_build.as_deref())
            .collect();
        out += &format!(" QEMU {q}");
        if !builds.is_empty() {
            let b: Vec<_> = builds.iter().map(|b| format!("`--qemu {b}`")).collect();
            out += &format!(" ({})", b.join(", "));
        }
        out += " |";
    }
    out += "\n|---|";
    out += &"---|".repeat(qemus.len());
    out += "\n";
    for k in &kernels {
        out += &format!("| {k} |");
        for q in &qemus {
            let here: Vec<_> = runs
                .iter()
                .filter(|r| r.kernel == *k && r.qemu == *q)
                .collect();
            let c = if here.is_empty() {
                "not run".to_string()
            } else {
                cell(&here)
            };
            out += &format!(" {} |", c.replace('|', "\\|"));
        }
        out += "\n";
    }
    let oldest = runs.iter().filter_map(|r| r.finished).min();
    let newest = runs.iter().filter_map(|r| r.finished).max();
    let when = match (oldest, newest) {
        (Some(a), Some(b)) => format!(
            ", finished between {} and {}",
            humantime::format_rfc3339_seconds(a),
            humantime::format_rfc3339_seconds(b)
        ),
        _ => String::new(),
    };
    out += &format!(
        "\n{} lab run(s){when}{}.{}\n",
        runs.len(),
        if skipped.is_empty() {
            String::new()
        } else {
            format!("; {} run director(ies) skipped", skipped.len())
        },
        host_kernels_line(runs)
    );
    out
}

/// " Host kernel(s): R (N runs), …": the kernel that verified the host agent's BPF in
/// each run, and how many runs did not record one.
fn host_kernels_line(runs: &[RunFacts]) -> String {
    let mut by: BTreeMap<&str, usize> = BTreeMap::new();
    for r in runs {
        *by.entry(r.host_kernel.as_deref().unwrap_or(""))
            .or_default() += 1;
    }
    let unknown = by.remove("").unwrap_or(0);
    if by.is_empty() {
        return String::new();
    }
    let mut parts: Vec<String> = by
        .iter()
        .map(|(k, n)| format!("{k} ({n} run(s))"))
        .collect();
    if unknown > 0 {
        parts.push(format!("not recorded ({unknown} run(s))"));
    }
    format!(" Host kernel(s): {}.", parts.join(", "))
}

mod run;
#[cfg(test)]
mod tests;
