//! Guest instructions per I/O, counted by QEMU itself: a TCG plugin
//! (`vm-tests/insn/insn_count.c`) counts every guest instruction executed, by where its code
//! lies (user space, the kernel image, the module area that also holds BPF programs and
//! trampolines), and writes the counts whenever the guest runs the marker
//! (`viotrace-insn-mark`: CPUID right after loading EAX with "VIOT"). A workload brackets what it measures
//! with two marks; fio does it with `--exec_prerun`/`--exec_postrun`.
//!
//! Unlike IOPS under emulation, the count does not depend on the host's speed or on how
//! QEMU's threads are scheduled: the same guest work gives the same count, so a tracer's
//! cost in the guest can be compared with the anchor's to a few instructions per I/O.
//! It counts instructions, not their cost: a probe read and a register move count one each.
//!
//! The plugin uses plugin API version 1, which QEMU builds before 9.0 load (9.0 raised the
//! minimum); the lab refuses the option with other builds and with KVM (plugins are TCG's).

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::assets::{self, fnv1a, lock_file};

/// The plugin's source (plugin API version 1).
const PLUGIN_SRC: &str = include_str!("../insn/insn_count.c");
/// The marker's source (static, no C library).
const MARK_SRC: &str = include_str!("../insn/insn_mark.c");
/// The marker's name in the guest.
pub const MARK: &str = "viotrace-insn-mark";
/// What fio runs before and after a job to bracket it with marks.
pub const FIO_MARKS: &str = "--exec_prerun=viotrace-insn-mark --exec_postrun=viotrace-insn-mark";
/// The run directory's file of marks.
pub const MARKS_FILE: &str = "insn.txt";
/// The run directory's profile (`--insn-profile`): at each mark, the guest's instructions
/// by block start address (user and kernel).
pub const PROFILE_FILE: &str = "insn-profile.txt";

/// The built plugin and marker.
#[derive(Clone, Debug)]
pub struct InsnTools {
    pub plugin: PathBuf,
    pub mark: PathBuf,
}

/// Builds (once, cached by the sources' hash) the plugin and the marker with clang.
pub fn ensure(cache: &Path) -> Result<InsnTools> {
    let key = fnv1a(format!("{PLUGIN_SRC}\0{MARK_SRC}").as_bytes());
    let dir = cache.join(format!("insn-{key:016x}"));
    let tools = InsnTools {
        plugin: dir.join("insn_count.so"),
        mark: dir.join(MARK),
    };
    if tools.plugin.is_file() && tools.mark.is_file() {
        return Ok(tools);
    }
    assets::need_tool("clang", "clang")?;
    fs::create_dir_all(&dir)?;
    let _lock = lock_file(&dir.join(".lock"))?;
    if tools.plugin.is_file() && tools.mark.is_file() {
        return Ok(tools);
    }
    let (psrc, msrc) = (dir.join("insn_count.c"), dir.join("insn_mark.c"));
    fs::write(&psrc, PLUGIN_SRC)?;
    fs::write(&msrc, MARK_SRC)?;
    let tmp = dir.join("insn_count.so.tmp");
    assets::run(
        Command::new("clang")
            .args([
                "-O2",
                "-shared",
                "-fPIC",
                "-fvisibility=hidden",
                "-Wall",
                "-o",
            ])
            .arg(&tmp)
            .arg(&psrc),
    )
    .context("building the instruction-count plugin")?;
    fs::rename(&tmp, &tools.plugin)?;
    let tmp = dir.join("mark.tmp");
    assets::run(
        Command::new("clang")
            .args([
                "-O2",
                "-static",
                "-nostdlib",
                "-ffreestanding",
                "-fno-stack-protector",
                "-Wall",
                "-o",
            ])
            .arg(&tmp)
            .arg(&msrc),
    )
    .context("building the instruction marker")?;
    fs::rename(&tmp, &tools.mark)?;
    Ok(tools)
}

/// Whether a QEMU release (`7.2.22`, `10.0.3`) loads the plugin (API version 1: before 9.0).
pub fn qemu_loads_plugin(version: &str) -> bool {
    version
        .split('.')
        .next()
        .and_then(|m| m.parse::<u32>().ok())
        .is_some_and(|major| major < 9)
}

/// Guest instructions by where their code lies.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counts {
    pub user: f64,
    pub kernel: f64,
    pub modules: f64,
    pub other: f64,
}

/// The regions, as the plugin and the bench name them.
pub const REGIONS: [&str; 4] = ["user", "kernel", "modules", "other"];

impl Counts {
    pub fn total(&self) -> f64 {
        self.user + self.kernel + self.modules + self.other
    }

    /// Region by name (one of [`REGIONS`], or `total`).
    pub fn get(&self, region: &str) -> Option<f64> {
        Some(match region {
            "user" => self.user,
            "kernel" => self.kernel,
            "modules" => self.modules,
            "other" => self.other,
            "total" => self.total(),
            _ => return None,
        })
    }

    fn set(&mut self, region: &str, v: f64) -> bool {
        let slot = match region {
            "user" => &mut self.user,
            "kernel" => &mut self.kernel,
            "modules" => &mut self.modules,
            "other" => &mut self.other,
            _ => return false,
        };
        *slot = v;
        true
    }

    /// What was executed from `earlier` to `self`.
    pub fn since(&self, earlier: &Counts) -> Counts {
        Counts {
            user: self.user - earlier.user,
            kernel: self.kernel - earlier.kernel,
            modules: self.modules - earlier.modules,
            other: self.other - earlier.other,
        }
    }

    /// Each region divided by `n` (e.g. per I/O).
    pub fn per(&self, n: u64) -> Counts {
        let d = n.max(1) as f64;
        Counts {
            user: self.user / d,
            kernel: self.kernel / d,
            modules: self.modules / d,
            other: self.other / d,
        }
    }
}

impl fmt::Display for Counts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.0} (user {:.0}, kernel {:.0}, modules/BPF {:.0}, other {:.0})",
            self.total(),
            self.user,
            self.kernel,
            self.modules,
            self.other
        )
    }
}

/// The marks of a plugin output, in order (its final `exit` line is not a mark).
pub fn parse_marks(text: &str) -> Result<Vec<Counts>> {
    let mut marks = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut w = line.split_whitespace();
        match w.next() {
            Some("mark") => {}
            Some("exit") | None => continue,
            Some(other) => bail!("line {}: unknown entry {other:?}", i + 1),
        }
        let _n = w.next().context("mark without its number")?;
        let mut c = Counts::default();
        let mut seen = 0;
        while let (Some(k), Some(v)) = (w.next(), w.next()) {
            let v: u64 = v
                .parse()
                .with_context(|| format!("line {}: count {v:?}", i + 1))?;
            if c.set(k, v as f64) {
                seen += 1;
            }
        }
        if seen != REGIONS.len() {
            bail!("line {}: {seen} of {} regions", i + 1, REGIONS.len());
        }
        marks.push(c);
    }
    Ok(marks)
}

/// The windows between marks taken in pairs (start, end), in order.
pub fn windows(marks: &[Counts]) -> Result<Vec<Counts>> {
    if !marks.len().is_multiple_of(2) {
        bail!("{} marks: not pairs of start and end", marks.len());
    }
    Ok(marks.chunks(2).map(|p| p[1].since(&p[0])).collect())
}

/// The windows of a run directory's marks file.
pub fn run_windows(run_dir: &Path) -> Result<Vec<Counts>> {
    let p = run_dir.join(MARKS_FILE);
    let text = fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))?;
    windows(&parse_marks(&text)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "mark 1 user 100 kernel 1000 modules 10 other 0\n\
                       mark 2 user 400 kernel 5000 modules 90 other 2\n\
                       mark 3 user 500 kernel 6000 modules 100 other 2\n\
                       mark 4 user 510 kernel 6100 modules 130 other 2\n\
                       exit 4 user 600 kernel 7000 modules 140 other 2\n";

    #[test]
    fn windows_are_pairs_of_marks() {
        let m = parse_marks(OUT).unwrap();
        assert_eq!(m.len(), 4);
        let w = windows(&m).unwrap();
        assert_eq!(w.len(), 2);
        assert_eq!(
            w[0],
            Counts {
                user: 300.0,
                kernel: 4000.0,
                modules: 80.0,
                other: 2.0
            }
        );
        assert_eq!(w[1].total(), 10.0 + 100.0 + 30.0);
        assert_eq!(w[0].per(4).kernel, 1000.0);
        assert_eq!(w[0].get("total"), Some(4382.0));
    }

    #[test]
    fn an_odd_or_malformed_file_is_refused() {
        let odd: String = OUT.lines().take(3).map(|l| format!("{l}\n")).collect();
        assert!(windows(&parse_marks(&odd).unwrap()).is_err());
        assert!(parse_marks("mark 1 user 1 kernel x modules 1 other 1\n").is_err());
        assert!(parse_marks("mark 1 user 1 kernel 2\n").is_err());
        assert!(parse_marks("hello\n").is_err());
    }

    #[test]
    fn only_api_1_builds_load_it() {
        assert!(qemu_loads_plugin("7.2.22"));
        assert!(qemu_loads_plugin("8.2.0"));
        assert!(!qemu_loads_plugin("10.0.3"));
        assert!(!qemu_loads_plugin("garbage"));
    }
}
