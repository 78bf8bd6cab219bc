//! The bench's guest instructions per I/O (`--insn-count`, see `insn.rs`): read from each
//! round's marks, and rendered against `none` and the anchor.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use super::{median, BenchResult, Samples, CONDITIONS, JOBS};
use crate::insn;

/// Guest instructions per I/O of each job of a round (its marks file, one window per job),
/// by region, into the condition's samples.
pub(super) fn note(
    dir: &Path,
    ios: &[u64],
    jobs: &mut BTreeMap<String, Samples>,
) -> Result<(), String> {
    let w = insn::run_windows(dir).map_err(|e| format!("instruction counts: {e:#}"))?;
    if w.len() != JOBS.len() || ios.len() != JOBS.len() {
        return Err(format!(
            "instruction counts: {} windows for {} jobs",
            w.len(),
            JOBS.len()
        ));
    }
    for ((j, c), n) in JOBS.iter().zip(&w).zip(ios) {
        let per = c.per(*n);
        let s = jobs.entry(j.name.to_string()).or_default();
        for r in insn::REGIONS.iter().chain(&["total"]) {
            let v = per.get(r).unwrap_or(0.0);
            s.insn_per_io.entry(r.to_string()).or_default().push(v);
        }
    }
    Ok(())
}

/// Median of a condition's job's region, if counted.
fn med(res: &BenchResult, cond: &str, job: &str, region: &str) -> Option<f64> {
    let v = res.jobs.get(cond)?.get(job)?.insn_per_io.get(region)?;
    (!v.is_empty()).then(|| median(v))
}

/// The table (empty without counts): per condition and job, the medians of the guest's
/// instructions per I/O, what each region adds over `none`, and the tracing's extra
/// against the anchor's.
pub(super) fn render(res: &BenchResult) -> String {
    let mut s = String::new();
    let counted = |c: &str| JOBS.iter().any(|j| med(res, c, j.name, "total").is_some());
    if !CONDITIONS.iter().any(|c| counted(c)) {
        return s;
    }
    let _ = writeln!(
        s,
        "\nguest instructions per I/O (QEMU's count; medians over rounds; +: over none, by where \
         the code lies)"
    );
    let _ = writeln!(
        s,
        "{:<8} {:<18} {:>9} {:>9} {:>9} {:>9} {:>11}",
        "tracing", "job", "total", "+total", "+user", "+kernel", "+mod/BPF"
    );
    for &c in CONDITIONS.iter().filter(|c| counted(c)) {
        for j in JOBS {
            let Some(t) = med(res, c, j.name, "total") else {
                continue;
            };
            let extra = |r: &str| match (med(res, c, j.name, r), med(res, "none", j.name, r)) {
                (Some(a), Some(b)) if c != "none" => format!("{:+.0}", a - b),
                _ => "-".into(),
            };
            let _ = writeln!(
                s,
                "{c:<8} {:<18} {t:>9.0} {:>9} {:>9} {:>9} {:>11}",
                j.name,
                extra("total"),
                extra("user"),
                extra("kernel"),
                extra("modules")
            );
        }
    }
    if counted("bpftrace") && counted("none") {
        let _ = writeln!(
            s,
            "\ntracing's extra guest instructions per I/O ÷ the anchor's (bpftrace), per job:"
        );
        for &c in CONDITIONS
            .iter()
            .filter(|c| !matches!(**c, "none" | "bpftrace") && counted(c))
        {
            let mut line = format!("  {c:<8}");
            for j in JOBS {
                let x = |cond: &str| {
                    Some(med(res, cond, j.name, "total")? - med(res, "none", j.name, "total")?)
                };
                match (x(c), x("bpftrace")) {
                    (Some(a), Some(b)) if b > 0.0 => {
                        let _ = write!(line, " {} {:.2}", j.name, a / b);
                    }
                    _ => {
                        let _ = write!(line, " {} -", j.name);
                    }
                }
            }
            let _ = writeln!(s, "{line}");
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(res: &mut BenchResult, cond: &str, user: f64, kernel: f64, modules: f64) {
        let s = res
            .jobs
            .entry(cond.into())
            .or_default()
            .entry("randread-4k-qd32".into())
            .or_default();
        for (r, v) in [
            ("user", user),
            ("kernel", kernel),
            ("modules", modules),
            ("other", 0.0),
            ("total", user + kernel + modules),
        ] {
            s.insn_per_io.insert(r.into(), vec![v, v + 2.0, v - 2.0]);
        }
    }

    #[test]
    fn the_table_shows_each_regions_extra_and_the_ratio_to_the_anchor() {
        let mut res = BenchResult::default();
        assert_eq!(render(&res), "", "no counts, no table");
        counted(&mut res, "none", 10_000.0, 40_000.0, 2_000.0);
        counted(&mut res, "guest", 10_600.0, 42_000.0, 5_000.0);
        counted(&mut res, "bpftrace", 10_000.0, 41_000.0, 3_000.0);
        let t = render(&res);
        let line = |c: &str| {
            t.lines()
                .find(|l| l.starts_with(c) && l.contains("randread-4k-qd32"))
                .unwrap_or_else(|| panic!("no {c} line in\n{t}"))
                .to_string()
        };
        let g = line("guest");
        let g: Vec<&str> = g.split_whitespace().collect();
        assert_eq!(g[2..], ["57600", "+5600", "+600", "+2000", "+3000"]);
        assert!(line("none").contains(" - "));
        // (5600 extra against the anchor's 2000)
        assert!(
            t.contains("guest    randread-4k-qd1 - randread-4k-qd32 2.80"),
            "{t}"
        );
    }

    #[test]
    fn a_round_without_one_window_per_job_is_refused() {
        let dir = std::env::temp_dir().join(format!("insn-note-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(insn::MARKS_FILE),
            "mark 1 user 0 kernel 0 modules 0 other 0\nmark 2 user 4 kernel 8 modules 0 other 0\n",
        )
        .unwrap();
        let mut jobs = BTreeMap::new();
        let e = note(&dir, &[1, 1, 1, 1], &mut jobs).unwrap_err();
        assert!(e.contains("1 windows for 4 jobs"), "{e}");
        assert!(jobs.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
