//! The host agent's BPF run time, for the bench's accounting pass (`--bpf-stats`).
//!
//! The guest's accounting script asks for a sample with a console line,
//! `VIOTRACE-HOST-BPF-SAMPLE start|end`; the lab then switches the host's
//! `kernel.bpf_stats_enabled` on (start) and back to what it was (end), and writes the
//! run time of each program the host agent holds to `host-bpf-progs.<label>.txt`, in
//! `bpftool prog show`'s words (`bench_accounting::parse_bpf_progs` reads both).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use libbpf_rs::query::ProgInfoIter;

/// The console line that asks for a sample: `VIOTRACE-HOST-BPF-SAMPLE <label>`.
pub const MARK_HOST_BPF: &str = "VIOTRACE-HOST-BPF-SAMPLE";

const STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// `kernel.bpf_stats_enabled` switched on; its earlier value comes back when dropped.
pub struct StatsOn {
    prev: String,
}

impl StatsOn {
    pub fn new() -> Result<StatsOn> {
        let prev = fs::read_to_string(STATS_SYSCTL).with_context(|| STATS_SYSCTL.to_string())?;
        fs::write(STATS_SYSCTL, "1").with_context(|| format!("writing 1 to {STATS_SYSCTL}"))?;
        Ok(StatsOn {
            prev: prev.trim().to_string(),
        })
    }
}

impl Drop for StatsOn {
    fn drop(&mut self) {
        let _ = fs::write(STATS_SYSCTL, &self.prev);
    }
}

/// The ids of the BPF programs a process holds a descriptor of (`prog_id:` in the
/// fdinfo of each).
pub fn prog_ids_of(pid: u32) -> Result<BTreeSet<u32>> {
    let dir = format!("/proc/{pid}/fdinfo");
    let mut ids = BTreeSet::new();
    for e in fs::read_dir(&dir).with_context(|| dir.clone())? {
        let Ok(text) = fs::read_to_string(e?.path()) else {
            continue; // closed meanwhile
        };
        ids.extend(parse_prog_id(&text));
    }
    Ok(ids)
}

fn parse_prog_id(fdinfo: &str) -> Option<u32> {
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("prog_id:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Each program of `pid`: name → (run_time_ns, run_cnt), summed over programs of one name.
pub fn sample(pid: u32) -> Result<BTreeMap<String, (u64, u64)>> {
    let ids = prog_ids_of(pid)?;
    let mut m = BTreeMap::new();
    for p in ProgInfoIter::default().filter(|p| ids.contains(&p.id)) {
        let e = m
            .entry(p.name.to_string_lossy().into_owned())
            .or_insert((0, 0));
        e.0 += p.run_time_ns;
        e.1 += p.run_cnt;
    }
    Ok(m)
}

/// A sample in `bpftool prog show`'s words, one line per program name.
pub fn render(m: &BTreeMap<String, (u64, u64)>) -> String {
    let mut s = String::new();
    for (name, (t, c)) in m {
        let _ = writeln!(s, "name {name}  run_time_ns {t} run_cnt {c}");
    }
    s
}

/// What the lab does on a sample line: `start` switches the accounting on (kept in `on`
/// until `end`), both write `host-bpf-progs.<label>.txt` into `out`, or
/// `host-bpf-progs.<label>.err` with why not.
pub fn on_marker(label: &str, pid: Option<u32>, on: &mut Option<StatsOn>, out: &Path) {
    let label: String = label
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(16)
        .collect();
    let res = (|| -> Result<String> {
        if label == "start" && on.is_none() {
            *on = Some(StatsOn::new()?);
        }
        let pid = pid.context("no host agent runs")?;
        Ok(render(&sample(pid)?))
    })();
    if label == "end" {
        *on = None;
    }
    let _ = match res {
        Ok(text) => fs::write(out.join(format!("host-bpf-progs.{label}.txt")), text),
        Err(e) => fs::write(
            out.join(format!("host-bpf-progs.{label}.err")),
            format!("{e:#}\n"),
        ),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_of_a_program_and_of_other_descriptors() {
        let prog = "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t1057\nprog_type:\t2\n\
                    prog_jited:\t1\nprog_tag:\t52f2b8cbe0cd2fd9\nmemlock:\t4096\nprog_id:\t318\n\
                    run_time_ns:\t0\nrun_cnt:\t0\n";
        assert_eq!(parse_prog_id(prog), Some(318));
        let map = "pos:\t0\nflags:\t02000002\nmap_type:\t27\nmap_id:\t91\n";
        assert_eq!(parse_prog_id(map), None);
        assert_eq!(parse_prog_id("pos:\t0\nflags:\t0100000\n"), None);
    }

    #[test]
    fn a_sample_reads_back_as_bpftool_output() {
        let mut m = BTreeMap::new();
        m.insert("vq_push".to_string(), (1_732_000u64, 1000u64));
        m.insert("pread_enter".to_string(), (850_000, 1000));
        let back = crate::bench::parse_bpf_progs(&render(&m));
        assert_eq!(back, m);
    }

    #[test]
    fn this_process_holds_no_program() {
        assert!(prog_ids_of(std::process::id()).unwrap().is_empty());
        assert!(prog_ids_of(u32::MAX).is_err());
    }
}
