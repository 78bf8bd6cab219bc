//! The host agent's BPF run time, for the bench's accounting pass (`--bpf-stats`).
//!
//! The guest's accounting script asks for a sample with a console line,
//! `VIOTRACE-HOST-BPF-SAMPLE start|end`; the lab then switches the host's BPF run-time
//! accounting on (start) and lets it go (end), and writes the
//! run time of each program the host agent holds to `host-bpf-progs.<label>.txt`, in
//! `bpftool prog show`'s words (`bench_accounting::parse_bpf_progs` reads both).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;

use anyhow::{bail, Context, Result};
use libbpf_rs::query::ProgInfoIter;

/// The console line that asks for a sample: `VIOTRACE-HOST-BPF-SAMPLE <label>`.
pub const MARK_HOST_BPF: &str = "VIOTRACE-HOST-BPF-SAMPLE";

/// The host's BPF run-time accounting, on while this lives: a `BPF_ENABLE_STATS` descriptor,
/// which the kernel counts with every other user of the accounting (and the
/// `kernel.bpf_stats_enabled` sysctl) and drops with the descriptor, also when the lab is
/// killed: the accounting is never left on behind it.
pub struct StatsOn {
    _fd: OwnedFd,
}

impl StatsOn {
    pub fn new() -> Result<StatsOn> {
        use libbpf_rs::libbpf_sys::{bpf_enable_stats, BPF_STATS_RUN_TIME};
        // SAFETY: takes a plain enum; returns a new descriptor or a negative errno.
        let fd = unsafe { bpf_enable_stats(BPF_STATS_RUN_TIME) };
        if fd < 0 {
            bail!(
                "BPF_ENABLE_STATS: {}",
                std::io::Error::from_raw_os_error(-fd)
            );
        }
        // SAFETY: `fd` was just created for this process, and nothing else owns it.
        Ok(StatsOn {
            _fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
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
    let mut ids = prog_ids_of(pid)?;
    let mut m = BTreeMap::new();
    // (the iterator ends at the first program it cannot read: the ones left are named)
    for p in ProgInfoIter::default() {
        if !ids.remove(&p.id) {
            continue;
        }
        let e = m
            .entry(p.name.to_string_lossy().into_owned())
            .or_insert((0, 0));
        e.0 += p.run_time_ns;
        e.1 += p.run_cnt;
    }
    if !ids.is_empty() {
        bail!("programs of process {pid} not read (ids {ids:?})");
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
    fn the_accounting_leaves_the_sysctl_of_other_users_alone() {
        // (the sysctl shows its own setting; the kernel counts the descriptors apart)
        let sysctl = || fs::read_to_string("/proc/sys/kernel/bpf_stats_enabled").unwrap();
        let before = sysctl();
        let on = StatsOn::new().expect("BPF_ENABLE_STATS (root)");
        assert_eq!(sysctl(), before);
        drop(on);
        assert_eq!(sysctl(), before);
    }

    #[test]
    fn this_process_holds_no_program() {
        assert!(prog_ids_of(std::process::id()).unwrap().is_empty());
        assert!(prog_ids_of(u32::MAX).is_err());
    }
}
