//! Unit tests of bench.rs (the parsers and the checks against the anchor).
use super::accounting::STATS_PREFIX;
use super::*;

fn samples(iops: f64) -> Samples {
    Samples {
        iops: vec![iops],
        ..Default::default()
    }
}

#[test]
fn verdicts_compare_with_the_anchor_within_the_run() {
    let mut res = BenchResult::default();
    for (cond, iops) in [
        ("none", 100.0),
        ("guest", 86.0),
        ("bpftrace", 90.0),
        ("both", 70.0),
    ] {
        res.jobs
            .entry(cond.into())
            .or_default()
            .insert("randread-4k-qd1".into(), samples(iops));
    }
    for (cond, ns) in [
        ("guest", 20_000.0),
        ("bpftrace", 10_000.0),
        ("capture", 31_000.0),
    ] {
        res.costs
            .entry(cond.into())
            .or_default()
            .guest_bpf_ns_per_io = vec![ns];
    }
    let v = verdicts(&res);
    let get = |p: &str| v.iter().find(|x| x.check.starts_with(p)).unwrap().clone();
    let g = get("guest: guest BPF");
    assert!(g.pass && (g.value - 2.0).abs() < 1e-9);
    assert!(!get("capture: guest BPF").pass);
    // 0.86 ≥ 0.90 − 0.05
    assert!(get("guest randread-4k-qd1").pass);
    // 0.70 < 0.90 − 0.10
    assert!(!get("both randread-4k-qd1").pass);
    assert!(render_verdicts(&v).contains("MISS"));
    assert!(get("runs that did not finish").pass);
    // A run that did not finish is reported and fails the run's checks.
    note_failure(&mut res, "both", 1, "lab VM timed out\nserial".into());
    assert!(!get_in(&verdicts(&res), "runs that did not finish").pass);
    assert!(render(&res).contains("FAILED run: both, round 2: lab VM timed out"));
    // Memory, host CPU and drop checks.
    let c = res.costs.entry("both".into()).or_default();
    c.guest_agent_peak_rss_kib = vec![9000];
    c.host_agent_rss_kib = vec![15000];
    c.host_agent_cpu_us_per_io = vec![1.5];
    c.host_agent_user_us_per_io = vec![1.2];
    c.drops = vec![0, 2];
    let v = verdicts(&res);
    assert!(!get_in(&v, "both: guest agent peak RSS").pass);
    assert!(get_in(&v, "both: host agent RSS at the end").pass);
    assert!(!get_in(&v, "both: host agent userspace µs CPU").pass);
    assert!(render(&res).contains("1.50 (u 1.20)"));
    // With QEMU's worker threads measured, their CPU per I/O is named beside it.
    assert!(!render(&res).contains("QEMU's I/O workers"));
    let c = res.costs.entry("both".into()).or_default();
    c.qemu_worker_us_per_io = vec![12.0, 61.0, 11.0];
    let v = verdicts(&res);
    let check = get_in(&v, "both: host agent userspace µs CPU").check;
    assert!(
        check.ends_with("per I/O (QEMU's I/O workers: 12.0)"),
        "{check}"
    );
    assert!(!get_in(&v, "both: drops").pass);
}

#[test]
fn bootstrap_intervals_tell_a_clear_result_from_noise() {
    use super::verdicts::bootstrap;
    let med = |d: &[Vec<f64>]| median(&d[0]) - median(&d[1]);
    // One round says nothing about the spread.
    assert_eq!(bootstrap(&[&[1.0], &[2.0, 3.0]], med), None);
    // Well apart: the whole interval on one side, around the point estimate.
    let a = [100.0, 102.0, 98.0, 101.0, 99.0];
    let b = [80.0, 82.0, 78.0, 81.0, 79.0];
    let (lo, hi) = bootstrap(&[&a, &b], med).unwrap();
    assert!(
        lo > 15.0 && hi < 25.0 && lo <= 20.0 && 20.0 <= hi,
        "{lo}..{hi}"
    );
    // Seeded: the same run renders the same interval.
    assert_eq!(bootstrap(&[&a, &b], med), Some((lo, hi)));
    // Overlapping spreads: the interval spans zero.
    let c = [95.0, 110.0, 90.0, 104.0, 99.0];
    let (lo, hi) = bootstrap(&[&a, &c], med).unwrap();
    assert!(lo < 0.0 && hi > 0.0, "{lo}..{hi}");
}

#[test]
fn iops_checks_carry_their_margin_and_say_when_the_rounds_cannot_tell() {
    let mut res = BenchResult::default();
    let rounds = |v: &[f64]| Samples {
        iops: v.to_vec(),
        ..Default::default()
    };
    for (cond, v) in [
        ("none", [100.0, 101.0, 99.0, 100.0, 102.0]),
        // clearly above the anchor's ratio − 0.05
        ("guest", [95.0, 96.0, 94.0, 95.0, 97.0]),
        // around the bound, with the spread of a TCG run
        ("both", [80.0, 95.0, 72.0, 88.0, 76.0]),
        ("bpftrace", [92.0, 93.0, 91.0, 92.0, 94.0]),
    ] {
        res.jobs
            .entry(cond.into())
            .or_default()
            .insert("randread-4k-qd1".into(), rounds(&v));
    }
    let v = verdicts(&res);
    let g = get_in(&v, "guest randread-4k-qd1");
    let (lo, hi) = g.margin.unwrap();
    assert!(g.pass && lo > 0.0 && lo <= g.value - g.bound && g.value - g.bound <= hi);
    assert!(!g.within_noise());
    let b = get_in(&v, "both randread-4k-qd1");
    assert!(b.within_noise(), "{:?}", b.margin);
    assert!(get_in(&v, "runs that did not finish").margin.is_none());
    let text = render_verdicts(&v);
    assert!(text.contains("margin +"), "{text}");
    assert!(text.contains("~ "), "{text}");
    assert!(text.contains("within noise"), "{text}");
}

fn get_in(v: &[Verdict], p: &str) -> Verdict {
    v.iter().find(|x| x.check.starts_with(p)).unwrap().clone()
}

#[test]
fn final_counters_are_parsed_and_losses_summed() {
    let c = parse_counters(
        "  counters: ringbuf_drop_rq=2 rq_emitted=900 kick_slot_lost=1 map_full_bios=3 \
         io_refs_truncated=1 uplink_unacked_at_exit=4 decode_errors=1 bios=x",
    );
    assert_eq!(c["rq_emitted"], 900);
    assert!(!c.contains_key("bios"));
    assert_eq!(losses(&c), 2 + 1 + 3 + 1 + 4 + 1);
    assert!(!is_loss("uplink_resent") && !is_loss("host_io_matched"));
}

#[test]
fn parses_bpftool_prog_show() {
    let t = "6: raw_tracepoint  name sys_enter  tag 52f2b8cbe0cd2fd9  gpl run_time_ns 1000 run_cnt 10\n\
             8: tracing  name fe_io_submit_one  tag 440df2c7d8f14a3a  gpl\n\
             \tloaded_at 2026-11-22T12:00:00+0000  uid 0\n";
    let m = parse_bpf_progs(t);
    assert_eq!(m.get("sys_enter"), Some(&(1000, 10)));
    assert_eq!(m.len(), 1);
}

#[test]
fn median_of_samples() {
    assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    assert!(median(&[]).is_nan());
}

#[test]
fn workload_runs_every_job() {
    let w = workload(3, false);
    for j in JOBS {
        assert!(w.contains(&format!("--output=/out/fio-{}.json", j.name)));
    }
}

#[test]
fn notify_traps_on_traced_queues_count_as_the_requests_own() {
    let c = |kv: &[(&str, u64)]| -> BTreeMap<String, u64> {
        kv.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    };
    // TCG, QEMU's synchronous path: a push and a virtio_notify per request, 67 notify
    // calls and 44 pushes for the console.
    let tcg = c(&[
        ("uprobe_hits", 551_271),
        ("records", 275_580),
        ("push_other_device", 44),
        ("virtio_notify_calls", 275_647),
        ("virtio_notify_traced", 275_580),
    ]);
    let (per_rq, other) = host_traps(&tcg, 1).unwrap();
    assert_eq!(other, 44 + 67);
    assert!((per_rq - 2.0).abs() < 1e-3, "{per_rq}");
    // The irqfd path: the push alone.
    let irqfd = c(&[("uprobe_hits", 1000), ("records", 1000)]);
    assert_eq!(host_traps(&irqfd, 5).unwrap(), (1.0, 0));
    assert!(host_traps(&c(&[]), 5).is_none());
}

#[test]
fn capture_writes_the_binary_capture_and_json_the_live_lines() {
    let base = VmConfig {
        guest_json: false,
        ..VmConfig::default()
    };
    let out = |c: &str| {
        let vm = condition_vm(c, &base, false, 3);
        (vm.agents, vm.guest_json, vm.guest_capture)
    };
    assert_eq!(out("guest"), (Agents::Guest, false, false));
    assert_eq!(out("capture"), (Agents::Guest, false, true));
    assert_eq!(out("json"), (Agents::Guest, true, false));
    assert_eq!(out("both"), (Agents::Both, false, false));
    assert_eq!(out("apart"), (Agents::Apart, false, false));
    assert_eq!(out("lean"), (Agents::Guest, false, false));
    assert_eq!(out("lean-both"), (Agents::Both, false, false));
    assert_eq!(out("lean-capture"), (Agents::Guest, false, true));
    // the lean conditions add their points to the base's guest arguments
    let base = VmConfig {
        guest_args: "-c fio".into(),
        ..base
    };
    for c in ["lean", "lean-both", "lean-capture"] {
        assert_eq!(
            condition_vm(c, &base, false, 3).guest_args,
            "-c fio --skip-points lean"
        );
    }
    assert_eq!(condition_vm("guest", &base, false, 3).guest_args, "-c fio");
    // The bench checks the capture itself (bench_records): no JSON decode of it.
    assert!(!condition_vm("capture", &base, false, 3).decode_capture);
}

#[test]
fn bpf_accounting_has_its_own_pass_after_the_window() {
    // The measured window never runs with bpf_stats_enabled...
    assert!(!workload(3, false).contains("bpf_stats_enabled"));
    let base = VmConfig::default();
    assert!(condition_vm("none", &base, true, 3).post.is_none());
    // (the host agent's programs are sampled by the lab during the same pass)
    for cond in ["host", "both"] {
        assert!(condition_vm(cond, &base, true, 3).post.is_some());
    }
    assert!(condition_vm("guest", &base, false, 3).post.is_none());
    // Each pass measures the side(s) where BPF runs: the anchor's programs too.
    for (cond, sides) in [
        ("guest", (true, false)),
        ("capture", (true, false)),
        ("json", (true, false)),
        ("host", (false, true)),
        ("both", (true, true)),
        ("apart", (true, true)),
        ("bpftrace", (true, false)),
    ] {
        let vm = condition_vm(cond, &base, true, 3);
        assert_eq!(accounting_sides(&vm), sides, "{cond}");
    }
    // ...the pass after it does, around every job.
    let post = condition_vm("guest", &base, true, 3).post.unwrap();
    let on = post
        .find("echo 1 >/proc/sys/kernel/bpf_stats_enabled")
        .unwrap();
    let off = post
        .find("echo 0 >/proc/sys/kernel/bpf_stats_enabled")
        .unwrap();
    for j in JOBS {
        let at = post
            .find(&format!("--output=/out/{STATS_PREFIX}{}.json", j.name))
            .unwrap();
        assert!(on < at && at < off);
    }
}

#[test]
fn bpf_accounting_is_read_per_io_of_its_pass() {
    let dir = std::env::temp_dir().join(format!("viotrace-bench-acct-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let mut res = BenchResult::default();
    // A failed pass is an error naming its log.
    fs::write(dir.join("post.rc"), "1\n").unwrap();
    fs::write(dir.join("post.log"), "bpftool: not found\n").unwrap();
    let e = bpf_accounting(&dir, "guest", (true, false), &mut res).unwrap_err();
    assert!(
        e.contains("rc \"1\"") && e.contains("bpftool: not found"),
        "{e}"
    );
    fs::write(dir.join("post.rc"), "0\n").unwrap();
    for j in JOBS {
        let fio = r#"{"jobs":[{"read":{"total_ios":250,"iops":100.0,"clat_ns":{"percentile":{}}},"write":{"total_ios":0}}]}"#;
        fs::write(dir.join(format!("{STATS_PREFIX}{}.json", j.name)), fio).unwrap();
    }
    let show = |t: u64| {
        format!("6: raw_tracepoint  name rq_issue  tag 52  gpl run_time_ns {t} run_cnt 10\n")
    };
    fs::write(dir.join("bpf-progs.start.txt"), show(1000)).unwrap();
    fs::write(dir.join("bpf-progs.end.txt"), show(1_001_000)).unwrap();
    bpf_accounting(&dir, "guest", (true, false), &mut res).unwrap();
    // 1 ms over the pass's 4 × 250 I/Os.
    assert_eq!(res.costs["guest"].guest_bpf_ns_per_io, vec![1000.0]);
    assert_eq!(
        res.jobs["guest"]["seqread-128k"].iops_bpf_stats,
        vec![100.0]
    );
    assert!(res.jobs["guest"]["seqread-128k"].iops.is_empty());
    assert!(res.costs["guest"].host_bpf_ns_per_io.is_empty());

    // Both agents: the host's sample, taken by the lab, read the same way; a sample the
    // lab could not take is an error that says why.
    let host = |t: u64| format!("name vq_push  run_time_ns {t} run_cnt 7\n");
    fs::write(dir.join("host-bpf-progs.start.txt"), host(5)).unwrap();
    fs::write(dir.join("host-bpf-progs.end.err"), "no host agent runs\n").unwrap();
    let e = bpf_accounting(&dir, "both", (true, true), &mut res).unwrap_err();
    assert!(e.contains("host-bpf-progs.end: no host agent runs"), "{e}");
    fs::remove_file(dir.join("host-bpf-progs.end.err")).unwrap();
    fs::write(dir.join("host-bpf-progs.end.txt"), host(2_000_005)).unwrap();
    bpf_accounting(&dir, "both", (true, true), &mut res).unwrap();
    let c = &res.costs["both"];
    assert_eq!(c.guest_bpf_ns_per_io.last(), Some(&1000.0));
    assert_eq!(c.host_bpf_ns_per_io, vec![2000.0]);
    assert_eq!(c.host_bpf_programs["vq_push"], vec![2000.0]);
    let text = render(&res);
    assert!(text.contains("host BPF run time 2000 ns per I/O"), "{text}");
    assert!(text.contains("vq_push"), "{text}");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn the_accounting_pass_asks_the_lab_for_the_hosts_sample() {
    let post = bpf_stats_pass(3);
    let line = format!("echo \"{} $1\" >&3", crate::host_bpf::MARK_HOST_BPF);
    assert!(post.contains(&line), "{post}");
    // the host's accounting is on before the first job starts
    let start = post.find("bpf_sample start").unwrap();
    let pause = post.find("sleep 1").unwrap();
    let first = post.find("fio ").unwrap();
    assert!(start < pause && pause < first, "{post}");
}

#[test]
fn host_threads_give_the_vcpu_wait_and_the_busiest_other_threads() {
    use crate::host_threads::{HostThreads, ThreadUse};
    let use_of = |role: &'static str, name: &str, run: f64, wait: f64| ThreadUse {
        role,
        name: name.into(),
        threads: 1,
        run_secs: run,
        wait_secs: wait,
        slices: 1,
    };
    let mut res = BenchResult::default();
    for (round, wait) in [(0, 1.0), (1, 3.0), (2, 2.0)] {
        let h = HostThreads {
            window_secs: 10.0,
            threads: vec![
                use_of("qemu", "CPU 0/TCG", 9.0, wait),
                use_of("qemu", "worker", 4.0 + round as f64, 0.0),
                use_of("vsock-backend", "vhost-device-vs", 1.5, 0.0),
                use_of("qemu", "IO mon_iothread", 0.001, 0.0),
            ],
            host_busy_share: Some(0.95),
            ended: 0,
        };
        accounting::note_host_threads(res.costs.entry("both".into()).or_default(), &h);
    }
    let c = &res.costs["both"];
    assert_eq!(c.vcpu_wait_share, vec![0.1, 0.3, 0.2]);
    let text = accounting::render_host_threads(&res);
    assert!(
        text.contains("both     vCPU wait  20.0 %  host busy  95.0 %  qemu/worker 50.0, vsock-backend/vhost-device-vs 15.0"),
        "{text}"
    );
    assert!(!text.contains("mon_iothread"), "{text}");
    // Without host thread samples there is no table.
    assert!(accounting::render_host_threads(&BenchResult::default()).is_empty());
}

#[test]
fn the_bench_runs_one_copy_of_each_agent() {
    let tmp = tempfile::tempdir().unwrap();
    let (g, h) = (tmp.path().join("g"), tmp.path().join("h"));
    fs::write(&g, b"guest build").unwrap();
    fs::write(&h, b"host build").unwrap();
    let out = tmp.path().join("bench");
    let vm = VmConfig {
        guest_bin: Some(g.clone()),
        host_bin: Some(h),
        ..VmConfig::default()
    };
    let all: Vec<String> = CONDITIONS.iter().map(|c| c.to_string()).collect();
    let built = with_agents_built(&vm, &all, &out).unwrap();
    let gb = built.guest_bin.clone().unwrap();
    assert_eq!(gb, out.join("bin/viotrace-guest"));
    assert_eq!(fs::read(&gb).unwrap(), b"guest build");
    let hb = built.host_bin.clone().unwrap();
    assert_eq!(fs::read(&hb).unwrap(), b"host build");
    // The copies, not the sources, are what the rounds run: a later build changes nothing.
    fs::write(&g, b"edited").unwrap();
    assert_eq!(fs::read(&gb).unwrap(), b"guest build");
    let cond = condition_vm("guest", &built, false, 4);
    assert_eq!(cond.guest_bin, Some(gb));
    // A source that does not exist is an error, not a silent rebuild.
    let bad = VmConfig {
        guest_bin: Some(tmp.path().join("missing")),
        ..vm
    };
    assert!(with_agents_built(&bad, &all, &out).is_err());
    // Only the agents the conditions run: `host` copies the host agent, not the guest's.
    let out2 = tmp.path().join("bench2");
    let host_only = with_agents_built(&bad, &["none".into(), "host".into()], &out2).unwrap();
    assert_eq!(host_only.guest_bin, bad.guest_bin);
    assert_eq!(host_only.host_bin, Some(out2.join("bin/viotrace-host")));
    assert!(!out2.join("bin/viotrace-guest").exists());
}

#[test]
fn each_round_rotates_the_conditions_so_each_takes_every_position() {
    let asked: Vec<String> = ["bpftrace", "none", "guest"].map(String::from).to_vec();
    assert_eq!(round_order(&asked, 0), ["none", "guest", "bpftrace"]);
    assert_eq!(round_order(&asked, 1), ["guest", "bpftrace", "none"]);
    assert_eq!(round_order(&asked, 2), ["bpftrace", "none", "guest"]);
    assert_eq!(round_order(&asked, 3), round_order(&asked, 0));
    assert!(round_order(&["nothing".to_string()], 1).is_empty());
}

#[test]
fn the_uprobe_hit_bound_names_the_options_that_trap_more() {
    let mut res = BenchResult::default();
    res.costs
        .entry("host".into())
        .or_default()
        .host_uprobe_hits_per_io = vec![6.9];
    let label = |res: &BenchResult| {
        let v = verdicts(res);
        get_in(&v, "host: host uprobe hits per block request").check
    };
    // A pooled report (no settings read back), or the default mode: the plain check.
    assert!(!label(&res).contains("default mode"), "{}", label(&res));
    let cfg = |args: &[&str]| BenchConfig {
        rounds: 1,
        runtime_secs: 1,
        vm: crate::VmConfig {
            host_args: args.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        },
        conditions: vec!["host".into()],
        bpf_stats: false,
        keep_records: false,
    };
    res.config = Some(cfg(&["-t", "20ms"]));
    assert!(!label(&res).contains("default mode"), "{}", label(&res));
    res.config = Some(cfg(&["--submit", "-t", "1ms", "--pop"]));
    let l = label(&res);
    assert!(
        l.contains("the bound is the default mode's, this run adds --submit --pop"),
        "{l}"
    );
    // Still judged against the issue's bound.
    assert!(!get_in(&verdicts(&res), "host: host uprobe hits").pass);
}

#[test]
fn iops_checks_pair_the_rounds_so_a_drifting_host_cancels_out() {
    let mut res = BenchResult::default();
    // The host's speed moves from round to round; the agent trails the anchor by 0.08 of
    // none's IOPS in every round (more than the 0.05 allowed).
    let speed = [1.0, 1.3, 0.8, 1.2, 0.9, 1.1];
    for (cond, ratio) in [("none", 1.0), ("guest", 0.70), ("bpftrace", 0.78)] {
        let iops = speed.iter().map(|s| 1000.0 * s * ratio).collect();
        let s = Samples {
            iops,
            ..Default::default()
        };
        let jobs = res.jobs.entry(cond.into()).or_default();
        jobs.insert("randread-4k-qd1".into(), s);
    }
    let g = get_in(&verdicts(&res), "guest randread-4k-qd1");
    assert!(g.check.contains("per round"), "{}", g.check);
    assert!((g.value + 0.08).abs() < 1e-9 && g.bound == -0.05, "{g:?}");
    let (lo, hi) = g.margin.unwrap();
    assert!(!g.pass && hi < 0.0 && !g.within_noise(), "{lo}..{hi}");
    // A failed run leaves the rounds unpaired: the medians' ratios are compared, and the
    // spread of the host's speed hides the same gap.
    note_failure(&mut res, "guest", 2, "lab VM timed out".into());
    let g = get_in(&verdicts(&res), "guest randread-4k-qd1");
    assert!(g.check.contains("IOPS ratio ≥ anchor's"), "{}", g.check);
    assert!(g.within_noise(), "{:?}", g.margin);
}

#[test]
fn the_lab_line_names_the_model_qemu_runs() {
    let mut vm = crate::VmConfig {
        accel: crate::config::Accel::Tcg,
        ..Default::default()
    };
    vm.cpu = None;
    let l = lab_line(&vm);
    assert!(l.ends_with("guest CPU max,-erms,-fsrm"), "{l}");
    vm.cpu = Some("max".into());
    assert!(
        lab_line(&vm).ends_with("guest CPU max"),
        "{}",
        lab_line(&vm)
    );
}
