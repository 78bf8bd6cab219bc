//! `viotrace-vm bench`: fio in the lab guest under four alternated conditions (no agents,
//! guest agent, host agent, both joined), with the cost of each agent.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::vm::{Agents, Lab, RunResult, VmConfig};
use crate::{assets, insn};

#[path = "bench_accounting.rs"]
mod accounting;
pub use accounting::parse_bpf_progs;
use accounting::{bpf_accounting, bpf_stats_pass, render_bpf_costs};

#[path = "bench_pool.rs"]
mod pool;
pub use pool::{lab_of, pool, Pooled};
#[path = "bench_records.rs"]
mod bench_records;
#[path = "bench_verdicts.rs"]
mod verdicts;
use verdicts::render_verdicts;
pub use verdicts::{verdicts, Verdict};

/// One fio job of the bench.
#[derive(Clone, Debug, Serialize)]
pub struct Job {
    pub name: &'static str,
    pub args: &'static str,
}

/// The bench's fio jobs.
pub const JOBS: &[Job] = &[
    Job {
        name: "randread-4k-qd1",
        args: "--rw=randread --bs=4k --ioengine=psync --iodepth=1",
    },
    Job {
        name: "randread-4k-qd32",
        args: "--rw=randread --bs=4k --ioengine=libaio --iodepth=32",
    },
    Job {
        name: "randwrite-4k-qd32",
        args: "--rw=randwrite --bs=4k --ioengine=libaio --iodepth=32",
    },
    Job {
        name: "seqread-128k",
        args: "--rw=read --bs=128k --ioengine=libaio --iodepth=4",
    },
];

/// Conditions, alternated in this order, rotated by one each round (`round_order`): no
/// agents, the guest agent always-on (`guest`: tables, no records written), in capture mode (`capture`: `--capture`, every
/// record to a file, rendered as JSON after the run) and with live JSON lines (`json`:
/// `--json`, every record as JSON as it comes), the host agent, both joined, both agents
/// unjoined (`apart`: not in the default set; what joining adds), the guest agent without
/// its four costliest optional points (`lean`: `--skip-points lean`) alone, joined
/// (`lean-both`) and capturing (`lean-capture`), and the anchor: a biolatency-style
/// bpftrace script in the guest.
pub const CONDITIONS: &[&str] = &[
    "none",
    "guest",
    "capture",
    "json",
    "host",
    "both",
    "apart",
    "lean",
    "lean-both",
    "lean-capture",
    "bpftrace",
];

/// What the `lean` conditions add to the guest agent's arguments.
pub const LEAN_ARGS: &str = "--skip-points lean";

/// Done-when bounds of issue 11, checked by [`verdicts`]: guest BPF run time per I/O as a
/// multiple of the anchor's (always-on, capture), and IOPS ratio margins below the anchor's
/// (guest-only, both joined).
pub const MAX_BPF_X_ALWAYS_ON: f64 = 2.0;
pub const MAX_BPF_X_CAPTURE: f64 = 3.0;
pub const GUEST_IOPS_MARGIN: f64 = 0.05;
pub const BOTH_IOPS_MARGIN: f64 = 0.10;

/// The anchor: bcc/bpftrace's classic biolatency (issue → complete histogram) in the guest.
const BPFTRACE_SCRIPT: &str = "tracepoint:block:block_rq_issue { @s[args->dev, args->sector] = nsecs; } \
tracepoint:block:block_rq_complete /@s[args->dev, args->sector]/ { \
@usecs = hist((nsecs - @s[args->dev, args->sector]) / 1000); delete(@s[args->dev, args->sector]); }";

fn condition_vm(cond: &str, base: &VmConfig, bpf_stats: bool, runtime: u32) -> VmConfig {
    let agents = match cond {
        "guest" | "capture" | "json" | "lean" | "lean-capture" => Agents::Guest,
        "host" => Agents::Host,
        "both" | "lean-both" => Agents::Both,
        "apart" => Agents::Apart,
        _ => Agents::None,
    };
    let mut vm = VmConfig {
        agents,
        name: format!("viotrace-bench-{cond}"),
        console: false,
        // bpftrace needs room; every condition gets the same memory.
        memory_mib: base.memory_mib.max(2048),
        guest_json: base.guest_json || cond == "json",
        guest_capture: cond.ends_with("capture"),
        // (the bench reads the capture itself: its JSON is not needed)
        decode_capture: false,
        // (the host agent's user/kernel split, sampled in the accounting pass: see
        // cpu_split.rs)
        sample_host_cpu: matches!(agents, Agents::Host | Agents::Both | Agents::Apart),
        ..base.clone()
    };
    if cond.starts_with("lean") {
        vm.guest_args = format!("{} {LEAN_ARGS}", base.guest_args)
            .trim()
            .to_string();
    }
    if cond == "bpftrace" {
        vm.guest_tools = vec!["bpftrace".into()];
        vm.setup = Some(format!(
            "bpftrace -e '{BPFTRACE_SCRIPT}' >/out/bpftrace.out 2>&1 &\n\
             echo $! >/run/anchor.pid\n\
             i=0; until grep -q Attaching /out/bpftrace.out; do i=$((i+1)); \
             [ $i -gt 1200 ] && exit 1; sleep 0.1; done\n"
        ));
    }
    if bpf_stats && cond != "none" {
        vm.guest_tools.push("bpftool".into());
        vm.post = Some(bpf_stats_pass(runtime));
    }
    vm
}

/// Whose BPF programs the accounting pass of a condition measures: (the guest's, the
/// host agent's). The guest's whenever BPF runs there: the guest agent's or the anchor's.
fn accounting_sides(vm: &VmConfig) -> (bool, bool) {
    let anchor = vm.guest_tools.iter().any(|t| t == "bpftrace");
    (vm.agents.guest() || anchor, vm.agents.host())
}

/// Samples of the anchor process, written where the lab reads the guest agent's.
const ANCHOR_SAMPLE: &str = "if [ -e /run/anchor.pid ]; then \
cat /proc/$(cat /run/anchor.pid)/stat >/out/guest-agent.$1.stat; \
cat /proc/$(cat /run/anchor.pid)/status >/out/guest-agent.$1.status; \
cat /proc/$(cat /run/anchor.pid)/smaps_rollup >/out/guest-agent.$1.smaps_rollup; fi\n";

/// Bench parameters.
#[derive(Clone, Debug, Serialize)]
pub struct BenchConfig {
    pub rounds: u32,
    /// Seconds per fio job.
    pub runtime_secs: u32,
    pub vm: VmConfig,
    /// Conditions to run (a subset of CONDITIONS, in that order).
    pub conditions: Vec<String>,
    /// Measure the guest's per-program BPF run time (kernel.bpf_stats_enabled + bpftool in
    /// the guest), in a pass of its own after each measured window (the accounting slows
    /// every hook, so the IOPS ratios are never taken with it on). Off by default.
    pub bpf_stats: bool,
    /// Keep every round's record files (`guest.jsonl`, `guest.cap`, …); by default those
    /// over 1 MiB are removed once the round is read (see `bench_records`).
    pub keep_records: bool,
}

/// Per (condition, job) samples over rounds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Samples {
    pub iops: Vec<f64>,
    pub p50_us: Vec<f64>,
    pub p99_us: Vec<f64>,
    pub ios: Vec<u64>,
    /// IOPS in the BPF accounting pass (`--bpf-stats`), not used for the ratios.
    pub iops_bpf_stats: Vec<f64>,
    /// Guest instructions per I/O (`--insn-count`), by region (`insn::REGIONS` and
    /// `total`), one value per round.
    pub insn_per_io: BTreeMap<String, Vec<f64>>,
}

/// Per condition costs over rounds.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Costs {
    pub guest_agent_cpu_us_per_io: Vec<f64>,
    pub host_agent_cpu_us_per_io: Vec<f64>,
    /// Its userspace part: the run time split as perf's samples of the agent's
    /// threads in the accounting pass are (`cpu_split.rs`; without that pass, and
    /// in bench runs before 2026-11-29 morning, as the window's utime and stime
    /// ticks were).
    pub host_agent_user_us_per_io: Vec<f64>,
    /// The samples of that split, per round (none: split by ticks).
    pub host_agent_cpu_samples: Vec<u64>,
    /// QEMU's I/O worker threads' run time per I/O (`aio=threads`): threads woken per
    /// request, as the host agent's are, that viotrace does not ship. The machine's
    /// price of such short bursts, printed beside the host agent's figure: the same
    /// agent measured 6× as much at an hour when these took 5× theirs.
    pub qemu_worker_us_per_io: Vec<f64>,
    pub qemu_cpu_us_per_io: Vec<f64>,
    pub guest_agent_peak_rss_kib: Vec<u64>,
    pub host_agent_peak_rss_kib: Vec<u64>,
    /// RSS at the end of the workload (steady state).
    pub guest_agent_rss_kib: Vec<u64>,
    pub host_agent_rss_kib: Vec<u64>,
    pub drops: Vec<u64>,
    /// Host agent uprobe/USDT hits per guest I/O (its `uprobe_hits` counter), when it reports them.
    pub host_uprobe_hits_per_io: Vec<f64>,
    /// Host agent traps for other devices' elements and virtio_notify calls, per run.
    pub host_other_traps: Vec<u64>,
    /// Guest BPF run time per I/O (ns, guest clock), with --bpf-stats (its own pass).
    pub guest_bpf_ns_per_io: Vec<f64>,
    /// Per program: ns per I/O, one value per round.
    pub guest_bpf_programs: BTreeMap<String, Vec<f64>>,
    /// The host agent's BPF run time per guest I/O (ns, host clock), in the same pass.
    pub host_bpf_ns_per_io: Vec<f64>,
    /// Per host program: ns per guest I/O, one value per round.
    pub host_bpf_programs: BTreeMap<String, Vec<f64>>,
    /// The vCPU threads' wait for a host CPU, share of the window.
    pub vcpu_wait_share: Vec<f64>,
    /// The host CPUs' busy share over the window (every process).
    pub host_busy_share: Vec<f64>,
    /// Per host thread group (`process/thread name`): its run time, share of the window.
    pub host_thread_run_share: BTreeMap<String, Vec<f64>>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct BenchResult {
    /// (not read back by `bench-report`: the tables do not need it, and it names the
    /// lab set-up from the JSON, `pool::lab_of`)
    #[serde(skip_deserializing)]
    pub config: Option<BenchConfig>,
    /// condition → job → samples.
    pub jobs: BTreeMap<String, BTreeMap<String, Samples>>,
    pub costs: BTreeMap<String, Costs>,
    /// Runs that did not finish: (condition, round, why).
    pub failed_runs: Vec<(String, u32, String)>,
}

/// The records missing from a checked capture (its error is noted as a failed run).
fn capture_lost(check: &Option<Result<u64, String>>) -> u64 {
    match check {
        Some(Ok(n)) => *n,
        _ => 0,
    }
}

fn note_failure(res: &mut BenchResult, cond: &str, round: u32, why: String) {
    eprintln!("bench: round {} condition {cond} FAILED: {why}", round + 1);
    res.failed_runs.push((cond.to_string(), round, why));
}

/// The result files of the measured window's fio jobs: `fio-<job>.json`.
const WINDOW_PREFIX: &str = "fio-";

/// The measured window's workload; with `marks`, each job between two instruction marks
/// (`insn.rs`).
fn workload(runtime: u32, marks: bool) -> String {
    format!(
        "set -e\nanchor_sample() {{ {ANCHOR_SAMPLE} }}\n\
         fio --name=prep --filename=/data/bench.dat --size=128M --rw=write --bs=1M \
         --direct=1 --output=/dev/null\nanchor_sample start\n{}anchor_sample end\n",
        fio_jobs(runtime, WINDOW_PREFIX, marks)
    )
}

/// The bench's fio jobs, their JSON results in `/out/<prefix><job>.json`; with `marks`,
/// fio runs the instruction marker just before and just after each job.
fn fio_jobs(runtime: u32, prefix: &str, marks: bool) -> String {
    let mut s = String::new();
    let m = if marks { insn::FIO_MARKS } else { "" };
    for j in JOBS {
        let _ = writeln!(
            s,
            "fio --name={n} --filename=/data/bench.dat --size=128M --direct=1 {a} {m} \
             --runtime={runtime} --time_based --output-format=json --output=/out/{prefix}{n}.json",
            n = j.name,
            a = j.args
        );
    }
    s
}

/// Reads fio's JSON result of one job: (IOPS, p50 µs, p99 µs, I/Os).
pub fn parse_fio(p: &Path) -> Result<(f64, f64, f64, u64)> {
    let text = fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
    let start = text.find('{').context("no JSON in fio output")?;
    let v: Value = serde_json::from_str(&text[start..]).context("fio JSON")?;
    let job = &v["jobs"][0];
    let mut iops = 0.0;
    let mut ios = 0;
    let mut p50 = 0.0f64;
    let mut p99 = 0.0f64;
    for dir in ["read", "write"] {
        let d = &job[dir];
        let n = d["total_ios"].as_u64().unwrap_or(0);
        if n == 0 {
            continue;
        }
        iops += d["iops"].as_f64().unwrap_or(0.0);
        ios += n;
        let pct = &d["clat_ns"]["percentile"];
        p50 = p50.max(pct["50.000000"].as_f64().unwrap_or(0.0) / 1e3);
        p99 = p99.max(pct["99.000000"].as_f64().unwrap_or(0.0) / 1e3);
    }
    if ios == 0 {
        bail!("fio job in {} did no I/O", p.display());
    }
    Ok((iops, p50, p99, ios))
}

/// An agent's final counters, from the `counters:` line of its totals (printed
/// to stdout in table mode, to stderr with `--json`): `name=value` pairs.
pub fn final_counters(r: &RunResult, agent: &str) -> BTreeMap<String, u64> {
    let mut last = None;
    for f in [format!("{agent}.jsonl"), format!("{agent}.log")] {
        if let Ok(text) = fs::read_to_string(r.path(&f)) {
            if let Some(l) = text.lines().rev().find(|l| l.contains("counters: ")) {
                last = Some(l.to_string());
            }
        }
    }
    parse_counters(last.as_deref().unwrap_or_default())
}

/// The host agent's traps (uprobe hits) per block request traced (fio's and the rest,
/// e.g. the file system's; else per fio I/O), and the traps its shared probes took for
/// other devices (the console's pushes and virtio_notify calls), which are left out and
/// shown on their own. virtio_notify calls on the traced queues (QEMU's synchronous
/// notification path) are the block requests' own traps and count.
fn host_traps(host: &BTreeMap<String, u64>, total_ios: u64) -> Option<(f64, u64)> {
    let n = |k: &str| host.get(k).copied().unwrap_or(0);
    let hits = *host.get("uprobe_hits")?;
    let other =
        n("push_other_device") + n("virtio_notify_calls").saturating_sub(n("virtio_notify_traced"));
    // (records: every element the agent got, also those taken from the pushed map at
    // stop, which records_emitted leaves out)
    let reqs = host
        .get("records")
        .or(host.get("records_emitted"))
        .copied()
        .unwrap_or(total_ios);
    Some((
        hits.saturating_sub(other) as f64 / reqs.max(1) as f64,
        other,
    ))
}

fn parse_counters(line: &str) -> BTreeMap<String, u64> {
    line.split_whitespace()
        .filter_map(|t| t.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

/// A counter that counts lost or degraded data: dropped or lost records,
/// state not tracked for a full map, records or lists cut short, records
/// unacknowledged when an agent stopped, records without a point or dropped
/// because a program the kernel skipped did not see them (`*_unseen`).
fn is_loss(name: &str) -> bool {
    [
        "drop",
        "lost",
        "full",
        "truncated",
        "unacked",
        "evicted",
        "errors",
        "in_flight_at_stop",
        "unseen",
    ]
    .iter()
    .any(|w| name.contains(w))
}

/// The sum of an agent's final loss counters (`is_loss`).
fn losses(counters: &BTreeMap<String, u64>) -> u64 {
    counters
        .iter()
        .filter(|(k, _)| is_loss(k))
        .map(|(_, v)| v)
        .sum()
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[s.len() / 2]
}

/// `vm` with the agents the conditions run built now and copied into `<out>/bin`: every
/// round runs that build, whatever happens to the tree meanwhile (the lab otherwise builds
/// the agents for each boot, and a source edit during a bench changed the guest agent from
/// its seventh round on), and the run keeps the binaries it measured. Binaries given in `vm`
/// are copied as they are; an agent no condition runs is neither built nor copied.
fn with_agents_built(vm: &VmConfig, conditions: &[String], out: &Path) -> Result<VmConfig> {
    let dir = out.join("bin");
    fs::create_dir_all(&dir)?;
    let runs = |side: fn(Agents) -> bool| {
        (conditions.iter()).any(|c| side(condition_vm(c, vm, false, 1).agents))
    };
    let keep = |needed: bool, given: &Option<PathBuf>, build: fn() -> Result<PathBuf>, name| {
        if !needed {
            return Ok(given.clone());
        }
        let src = given.clone().map_or_else(build, Ok)?;
        let dst = dir.join(name);
        fs::copy(&src, &dst).with_context(|| format!("copy {} into the bench", src.display()))?;
        Ok::<_, anyhow::Error>(Some(dst))
    };
    Ok(VmConfig {
        guest_bin: keep(
            runs(Agents::guest),
            &vm.guest_bin,
            assets::guest_agent_binary,
            "viotrace-guest",
        )?,
        host_bin: keep(
            runs(Agents::host),
            &vm.host_bin,
            assets::host_agent_binary,
            "viotrace-host",
        )?,
        ..vm.clone()
    })
}

/// Runs the bench; writes `bench.json` and `bench.txt` into `out`.
pub fn run(lab: &Lab, cfg: &BenchConfig, out: &Path) -> Result<BenchResult> {
    fs::create_dir_all(out)?;
    if let Some(bad) = cfg
        .conditions
        .iter()
        .find(|c| !CONDITIONS.contains(&c.as_str()))
    {
        bail!(
            "unknown bench condition {bad:?} (known: {})",
            CONDITIONS.join(", ")
        );
    }
    let mut vm = with_agents_built(&cfg.vm, &cfg.conditions, out)?;
    // (the model the runs get, named in bench.json: a default may change)
    vm.cpu
        .get_or_insert_with(|| crate::config::cpu_arg(None, vm.accel.resolve()));
    let cfg = &BenchConfig { vm, ..cfg.clone() };
    let mut res = BenchResult {
        config: Some(cfg.clone()),
        ..Default::default()
    };
    let wl = workload(cfg.runtime_secs, cfg.vm.insn_count);
    let mut removed = 0u64;
    for round in 0..cfg.rounds {
        for cond in round_order(&cfg.conditions, round) {
            let name = cond.to_string();
            let dir: PathBuf = out.join(format!("round{round}-{name}"));
            let vm = condition_vm(cond, &cfg.vm, cfg.bpf_stats, cfg.runtime_secs);
            eprintln!(
                "bench: round {} of {}, condition {name}",
                round + 1,
                cfg.rounds
            );
            // A failed run (a hung guest, a crashed agent) is a finding: counted and
            // reported, and the other runs go on.
            let r = match lab.run(&vm, &wl, &dir) {
                Ok(r) if r.workload_rc == 0 => r,
                Ok(r) => {
                    let why = format!("workload rc {}: {}", r.workload_rc, r.workload_log());
                    note_failure(&mut res, &name, round, why);
                    continue;
                }
                Err(e) => {
                    note_failure(&mut res, &name, round, format!("{e:#}"));
                    continue;
                }
            };
            note_run(&mut res, &name, round, &vm, &r, &dir)?;
            if !cfg.keep_records {
                removed += bench_records::trim(&dir)?;
            }
            fs::write(out.join("bench.json"), serde_json::to_vec_pretty(&res)?)?;
        }
    }
    if removed > 0 {
        eprintln!(
            "bench: removed {:.0} MiB of record files after their rounds were read (each round's \
             records-removed.txt lists them; --keep-records keeps them)",
            removed as f64 / (1u64 << 20) as f64
        );
    }
    let table = render(&res);
    fs::write(out.join("bench.txt"), &table)?;
    fs::write(out.join("bench.json"), serde_json::to_vec_pretty(&res)?)?;
    print!("{table}");
    Ok(res)
}

/// One finished run of condition `name` in round `round` into `res`: its fio
/// jobs, its costs per I/O, its drops and its BPF accounting.
fn note_run(
    res: &mut BenchResult,
    name: &str,
    round: u32,
    vm: &VmConfig,
    r: &RunResult,
    dir: &Path,
) -> Result<()> {
    let mut total_ios = 0u64;
    let mut job_ios = Vec::new();
    for j in JOBS {
        let (iops, p50, p99, ios) =
            parse_fio(&dir.join(format!("{WINDOW_PREFIX}{}.json", j.name)))?;
        total_ios += ios;
        job_ios.push(ios);
        let s = res
            .jobs
            .entry(name.to_string())
            .or_default()
            .entry(j.name.to_string())
            .or_default();
        s.iops.push(iops);
        s.p50_us.push(p50);
        s.p99_us.push(p99);
        s.ios.push(ios);
    }
    if vm.insn_count {
        let jobs = res.jobs.entry(name.to_string()).or_default();
        if let Err(why) = insn_table::note(dir, &job_ios, jobs) {
            note_failure(res, name, round, why);
        }
    }
    let c = res.costs.entry(name.to_string()).or_default();
    let per_io = |secs: f64| secs * 1e6 / total_ios.max(1) as f64;
    if let Some(u) = r.metrics.qemu {
        c.qemu_cpu_us_per_io.push(per_io(u.cpu_secs));
    }
    if let Some(u) = r.metrics.guest_agent {
        c.guest_agent_cpu_us_per_io.push(per_io(u.cpu_secs));
        c.guest_agent_peak_rss_kib.push(u.peak_rss_kib);
        c.guest_agent_rss_kib.push(u.rss_kib);
    }
    if let Some(u) = r.metrics.host_agent {
        c.host_agent_cpu_us_per_io.push(per_io(u.cpu_secs));
        // The sampled split, else the ticks' (an older run's).
        let sampled = r.metrics.host_agent_split;
        let share = sampled.and_then(|s| s.user_share()).or(u.user_share);
        if let Some(share) = share {
            c.host_agent_user_us_per_io.push(per_io(u.cpu_secs * share));
        }
        if let Some(s) = sampled {
            c.host_agent_cpu_samples.push(s.user + s.kernel);
        }
        c.host_agent_peak_rss_kib.push(u.peak_rss_kib);
        c.host_agent_rss_kib.push(u.rss_kib);
    }
    if let Some(h) = &r.metrics.host_threads {
        accounting::note_host_threads(c, h);
        let workers = h
            .threads
            .iter()
            .filter(|t| t.role == "qemu" && t.name == "worker");
        let secs: f64 = workers.map(|t| t.run_secs).sum();
        if secs > 0.0 {
            c.qemu_worker_us_per_io.push(per_io(secs));
        }
    }
    // Each agent's final counters, read once.
    let (guest, host) = (final_counters(r, "guest"), final_counters(r, "host"));
    // A capture holds every record the agent counted as written.
    let capture = vm
        .guest_capture
        .then(|| bench_records::capture_shortfall(dir, &guest));
    c.drops
        .push(losses(&guest) + losses(&host) + capture_lost(&capture));
    if let Some((per_rq, other)) = host_traps(&host, total_ios) {
        c.host_uprobe_hits_per_io.push(per_rq);
        c.host_other_traps.push(other);
    }
    if let Some(Err(why)) = capture {
        note_failure(res, name, round, why);
    }
    if vm.post.is_some() {
        if let Err(why) = bpf_accounting(dir, name, accounting_sides(vm), res) {
            note_failure(res, name, round, why);
        }
    }
    Ok(())
}

/// The conditions of round `round` (0-based): those asked for, in [`CONDITIONS`]' order
/// rotated by the round. Over as many rounds as conditions, each one runs once in every
/// position, so a drift of the host's speed within a round (a slower phase late in it)
/// lands on no condition more than on another. (Runs before 2026-12-06 13:00 UTC kept
/// the same order every round: `none` first, the anchor last.)
pub fn round_order(conditions: &[String], round: u32) -> Vec<&'static str> {
    let asked: Vec<&'static str> = CONDITIONS
        .iter()
        .copied()
        .filter(|c| conditions.iter().any(|x| x == c))
        .collect();
    if asked.is_empty() {
        return asked;
    }
    let k = round as usize % asked.len();
    asked[k..].iter().chain(&asked[..k]).copied().collect()
}

/// The lab set-up a bench ran on, as its report's first line says it (the words
/// `bench-report` prints for a run's `bench.json`: [`pool::lab_of`]).
pub fn lab_line(vm: &VmConfig) -> String {
    // The model as QEMU gets it (`run` names the one it resolved): a config naming none
    // runs the lab's (`cpu_arg`), which `lab_of` would read as the `null` of 9e22e48's runs.
    let mut v = serde_json::json!({ "config": { "vm": vm } });
    v["config"]["vm"]["cpu"] = crate::config::cpu_arg(vm.cpu.as_deref(), vm.accel.resolve()).into();
    pool::lab_of(&v).unwrap_or_default()
}

/// The readable table: medians over rounds and ratios to "no agents".
pub fn render(res: &BenchResult) -> String {
    let mut s = String::new();
    if let Some(c) = &res.config {
        let _ = writeln!(s, "lab: {}\n", lab_line(&c.vm));
    }
    let base = res.jobs.get("none");
    let _ = writeln!(
        s,
        "{:<8} {:<18} {:>10} {:>7} {:>10} {:>10} {:>7}",
        "tracing", "job", "IOPS", "ratio", "p50 µs", "p99 µs", "p99 x"
    );
    for &name in CONDITIONS {
        let Some(jobs) = res.jobs.get(name) else {
            continue;
        };
        for j in JOBS {
            let Some(sm) = jobs.get(j.name) else { continue };
            let b = base.and_then(|b| b.get(j.name));
            let iops = median(&sm.iops);
            let p99 = median(&sm.p99_us);
            let ratio = b.map(|b| iops / median(&b.iops)).unwrap_or(f64::NAN);
            let p99r = b.map(|b| p99 / median(&b.p99_us)).unwrap_or(f64::NAN);
            let _ = writeln!(
                s,
                "{name:<8} {:<18} {iops:>10.0} {ratio:>7.3} {:>10.0} {p99:>10.0} {p99r:>7.3}",
                j.name,
                median(&sm.p50_us)
            );
        }
    }
    let _ = writeln!(
        s,
        "\n{:<8} {:>16} {:>18} {:>16} {:>20} {:>20} {:>7}",
        "tracing",
        "guest µs CPU/IO",
        "host µs CPU/IO",
        "QEMU µs CPU/IO",
        "guest RSS peak/end",
        "host RSS peak/end",
        "drops"
    );
    let qbase = res.costs.get("none").map(|c| median(&c.qemu_cpu_us_per_io));
    for &name in CONDITIONS {
        let Some(c) = res.costs.get(name) else {
            continue;
        };
        let q = median(&c.qemu_cpu_us_per_io);
        let qx = qbase
            .map(|b| format!("{q:.1} ({:+.1})", q - b))
            .unwrap_or_default();
        // KiB: the largest peak (VmHWM) and the largest end-of-workload RSS over rounds.
        let rss = |peak: &Vec<u64>, end: &Vec<u64>| match (peak.iter().max(), end.iter().max()) {
            (Some(p), Some(e)) => format!("{p}/{e}"),
            _ => "-".into(),
        };
        let us = |v: &Vec<f64>| {
            if v.is_empty() {
                "-".to_string()
            } else {
                format!("{:.2}", median(v))
            }
        };
        let _ = writeln!(
            s,
            "{name:<8} {:>16} {:>18} {qx:>16} {:>20} {:>20} {:>7}",
            us(&c.guest_agent_cpu_us_per_io),
            host_us(c),
            rss(&c.guest_agent_peak_rss_kib, &c.guest_agent_rss_kib),
            rss(&c.host_agent_peak_rss_kib, &c.host_agent_rss_kib),
            c.drops.iter().sum::<u64>()
        );
    }
    for (cond, round, why) in &res.failed_runs {
        let first = why.lines().next().unwrap_or_default();
        let _ = writeln!(s, "FAILED run: {cond}, round {}: {first}", round + 1);
    }
    s += &accounting::render_host_threads(res);
    s += &render_verdicts(&verdicts(res));
    s += &render_bpf_costs(res);
    s += &insn_table::render(res);
    s
}

/// The host agent's CPU per I/O, and its userspace part: `1.19 (u 1.01)`.
fn host_us(c: &Costs) -> String {
    match (&c.host_agent_cpu_us_per_io, &c.host_agent_user_us_per_io) {
        (all, _) if all.is_empty() => "-".into(),
        (all, user) if user.is_empty() => format!("{:.2}", median(all)),
        (all, user) => format!("{:.2} (u {:.2})", median(all), median(user)),
    }
}

#[cfg(test)]
#[path = "bench_tests.rs"]
mod tests;

#[path = "bench_insn.rs"]
mod insn_table;
