//! End-to-end tests of the guest agent (issue 3) in real guests.

use viotrace_shared::record::{GuestRq, Op, Point, Points, Stats};
use viotrace_vm_tests::assets::GuestKernel;
use viotrace_vm_tests::{Agents, RunResult, VmConfig, VsockMode};

mod common;
use common::guest::{counter, totals_rows};
use common::{known_io_shape, run_agents, Shape, KNOWN_IO};

fn run_guest(name: &str, cfg: VmConfig, workload: &str) -> RunResult {
    let r = run_agents(name, Agents::Guest, cfg, workload);
    assert_eq!(r.guest_agent_rc, Some(0), "guest agent exit status");
    r
}

/// KNOWN_IO in the default guest, the agent run with `args`.
fn run_known_io(name: &str, args: &str) -> RunResult {
    let cfg = VmConfig {
        guest_args: args.into(),
        ..VmConfig::default()
    };
    run_guest(name, cfg, KNOWN_IO)
}

/// The guest's block requests, all disks.
fn guest_rqs(r: &RunResult) -> Vec<GuestRq> {
    let recs = r.records("guest.jsonl").expect("guest.jsonl");
    recs.guest_rqs().into_iter().cloned().collect()
}

/// The guest's block requests on vdb.
fn vdb_rqs(r: &RunResult) -> Vec<GuestRq> {
    guest_rqs(r)
        .into_iter()
        .filter(|v| v.disk == "vdb")
        .collect()
}

fn guest_log(r: &RunResult) -> String {
    std::fs::read_to_string(r.path("guest.log")).unwrap_or_default()
}

/// libbpf mapped the kernel's BTF (a private copy where the kernel's file
/// cannot be mapped, before 6.16) instead of reading it into two copies, and
/// the embedded BPF object's pages were handed back before the load.
fn assert_btf_mapped(log: &str) {
    assert!(
        !log.contains("libbpf copies the kernel's BTF"),
        "the BTF copy was not bound: {log}"
    );
    assert!(
        !log.contains("embedded BPF object stays resident"),
        "the embedded object's pages were not released: {log}"
    );
}

/// Points present in a record, in path order, must carry non-decreasing times.
fn assert_points_in_order(ts: &Points, rec: &dyn std::fmt::Debug) {
    let mut seen: Vec<(Point, u64)> = ts
        .iter()
        .inspect(|(p, t)| assert!(*t > 0, "zero timestamp for {p}: {rec:?}"))
        .collect();
    seen.sort();
    for w in seen.windows(2) {
        // Buffered I/O: the syscall can return before its write-back request is issued.
        if w[1].0 == Point::SyscallExit {
            continue;
        }
        assert!(
            w[0].1 <= w[1].1,
            "{} ({}) after {} ({}) in {rec:?}",
            w[0].0,
            w[0].1,
            w[1].0,
            w[1].1
        );
    }
}

/// Checks the KNOWN_IO records on vdb; returns them.
fn check_known_io(r: &RunResult, with_virtio: bool) -> Vec<GuestRq> {
    check_io(r, with_virtio, &known_io_shape())
}

/// Checks the vdb records against `shape` ((op, bytes) → count); returns them.
fn check_io(r: &RunResult, with_virtio: bool, shape: &Shape) -> Vec<GuestRq> {
    let rqs = vdb_rqs(r);
    let mut by_shape = Shape::new();
    for v in &rqs {
        *by_shape
            .entry((v.op.name().to_string(), u64::from(v.bytes)))
            .or_default() += 1;
    }
    // Program runs the kernel skipped (one would have nested in another on the same
    // CPU; 7.x counts them): a request whose block_rq_issue run was skipped is
    // tracked from its virtqueue add instead, without g.rq_issue; in tracepoint
    // mode, which has no virtqueue hook, it is lost, and counted there.
    let runs_lost = final_stats(r)
        .counters
        .and_then(|c| c.get("bpf_runs_lost").copied())
        .unwrap_or(0) as usize;
    let missing: usize = shape
        .iter()
        .map(|(k, &n)| n.saturating_sub(by_shape.get(k).copied().unwrap_or(0)))
        .sum();
    let extra = by_shape
        .iter()
        .any(|(k, &n)| n > shape.get(k).copied().unwrap_or(0));
    assert!(
        !extra && missing <= runs_lost,
        "vdb requests by (op, bytes): {by_shape:?}, want {shape:?} \
         ({runs_lost} skipped program runs); log:\n{}",
        guest_log(r)
    );
    // Driver completions the kernel skipped (a kprobe run nested in another
    // BPF program's: before 6.7 not in bpf_runs_lost), which the agent counts:
    // such a request has neither g.driver_complete nor g.irq.
    let driver_unseen = final_stats(r)
        .counters
        .and_then(|c| c.get("driver_complete_unseen").copied())
        .unwrap_or(0) as usize;
    let mut without_irq = 0;
    let mut without_issue = 0;
    let mut dd_sectors: Vec<u64> = Vec::new();
    for v in &rqs {
        let sector = v.sector;
        assert!(v.pid > 0 && v.tid > 0, "{v:?}");
        if v.bytes == 4096 {
            assert_eq!(v.comm, "fio", "{v:?}");
            assert!(sector % 8 == 0 && sector * 512 < 32 << 20, "{v:?}");
        } else {
            assert_eq!(v.comm, "dd", "{v:?}");
            dd_sectors.push(sector);
        }
        if with_virtio {
            let head = v.head.unwrap_or_else(|| panic!("head missing: {v:?}"));
            assert!(head < 256, "head {head} outside the 256-entry queue: {v:?}");
            assert_eq!(v.queue, Some(0), "{v:?}");
            for p in [Point::VqAdd, Point::Kick, Point::RqComplete] {
                assert!(v.ts.get(p).is_some(), "{p} missing in {v:?}");
            }
            if v.ts.get(Point::Irq).is_none() {
                assert!(
                    v.ts.get(Point::DriverComplete).is_none(),
                    "g.irq missing in {v:?}"
                );
                without_irq += 1;
            }
        }
        if v.ts.get(Point::RqIssue).is_none() {
            assert!(
                v.ts.get(Point::QueueRq).is_some() && v.ts.get(Point::VqAdd).is_some(),
                "g.rq_issue missing, and not tracked from the virtqueue add: {v:?}"
            );
            without_issue += 1;
        }
        assert!(v.ts.get(Point::RqComplete).is_some(), "{v:?}");
        assert_points_in_order(&v.ts, v);
    }
    assert!(
        without_issue <= runs_lost,
        "{without_issue} records without g.rq_issue, {runs_lost} program runs skipped"
    );
    assert!(
        without_irq <= driver_unseen,
        "{without_irq} records without g.irq, {driver_unseen} driver completions counted unseen"
    );
    dd_sectors.sort();
    assert_eq!(
        dd_sectors,
        (0..50).map(|i| i * 128).collect::<Vec<u64>>(),
        "dd's sequential 64 KiB reads"
    );
    rqs
}

#[test]
fn fentry_mode_sees_every_request_down_to_the_virtqueue() {
    let r = run_known_io("guest-fentry", "--mode fentry");
    check_fentry_run(&r);
    let log = guest_log(&r);
    assert!(log.contains("syscalls: fentry/fexit on"), "{log}");
}

/// With `--syscall-tracepoints` the raw syscall tracepoints replace the
/// per-syscall trampolines: the same requests, syscalls and points.
#[test]
fn syscall_tracepoints_see_the_same_requests_and_syscalls() {
    let r = run_known_io("guest-sys-tp", "--mode fentry --syscall-tracepoints");
    check_fentry_run(&r);
    let log = guest_log(&r);
    assert!(
        log.contains("syscalls: --syscall-tracepoints: the raw sys_enter/sys_exit tracepoints"),
        "{log}"
    );
    assert!(!log.contains("syscalls: fentry/fexit on"), "{log}");
}

/// KNOWN_IO seen down to the virtqueue, each direct syscall with its one
/// request, and the log honest about the mode and the kick's source.
fn check_fentry_run(r: &RunResult) {
    let rqs = check_known_io(r, true);
    // Syscall-level records: each direct I/O syscall caused exactly one vdb request.
    let recs = r.records("guest.jsonl").unwrap();
    let ios: Vec<_> = recs
        .guest_ios()
        .into_iter()
        .filter(|v| v.requests.iter().any(|q| q.disk == "vdb"))
        .collect();
    assert_eq!(
        ios.len(),
        rqs.len(),
        "guest_io records that caused vdb requests"
    );
    for io in ios {
        assert_eq!(io.requests.len(), 1, "{io:?}");
        assert!(
            io.ts.get(Point::SyscallEnter).is_some() && io.ts.get(Point::SyscallExit).is_some()
        );
    }
    // The agent is honest about what it sees, and says where g.kick comes from.
    let log = guest_log(r);
    assert!(log.to_lowercase().contains("fentry"), "{log}");
    assert_btf_mapped(&log);
    assert!(
        log.contains("g.kick: when virtqueue_kick_prepare returned"),
        "{log}"
    );
}

#[test]
fn exact_kick_also_traps_virtqueue_notify() {
    let r = run_known_io("guest-exact-kick", "--mode fentry --exact-kick");
    check_known_io(&r, true);
    let log = guest_log(&r);
    // virtqueue_notify attached: no note about the cheaper source, nothing blind about it
    assert!(
        !log.contains("g.kick: when virtqueue_kick_prepare returned"),
        "{log}"
    );
    assert!(!log.contains("exact g.kick time"), "{log}");
}

#[test]
fn kprobe_mode_sees_every_request_down_to_the_virtqueue() {
    let r = run_known_io("guest-kprobe", "--mode kprobe");
    check_known_io(&r, true);
}

#[test]
fn tracepoint_mode_degrades_to_block_layer_points() {
    let r = run_known_io("guest-tracepoint", "--mode tracepoint");
    let rqs = check_known_io(&r, false);
    for v in &rqs {
        assert!(
            v.ts.get(Point::VqAdd).is_none(),
            "tracepoint mode cannot see vq_add: {v:?}"
        );
        assert!(v.ts.get(Point::Kick).is_none(), "{v:?}");
    }
    let log = guest_log(&r);
    assert!(
        log.contains("tracepoint"),
        "the agent says which mode it runs in: {log}"
    );
}

/// 2 vCPUs and 2 virtqueues: blk-mq submits through virtio_queue_rqs (batched); 400 exact
/// reads on both queues, each with its descriptor head. Each job is pinned to its own vCPU
/// (blk-mq maps vCPU n to queue n), so both queues are used whatever the scheduler does.
fn check_two_queues(name: &str, kernel: GuestKernel) -> RunResult {
    let wl = "set -e\n\
        fio --name=q --filename=/dev/vdb --rw=randread --bs=4k --direct=1 --ioengine=libaio \
        --iodepth=8 --numjobs=2 --cpus_allowed=0,1 --cpus_allowed_policy=split --size=32M \
        --number_ios=200 --randrepeat=0 --output=/dev/null\n";
    let r = run_guest(
        name,
        VmConfig {
            smp: 2,
            queues: 2,
            guest_kernel: kernel,
            ..VmConfig::default()
        },
        wl,
    );
    let rqs = vdb_rqs(&r);
    assert_eq!(rqs.len(), 400, "2 jobs x 200 reads");
    let mut queues = std::collections::BTreeSet::new();
    for v in &rqs {
        assert_eq!(v.op, Op::Read);
        assert_eq!(v.bytes, 4096);
        let head = v.head.expect("head");
        assert!(head < 256);
        queues.insert(v.queue.expect("queue"));
        assert_points_in_order(&v.ts, v);
    }
    assert_eq!(
        queues.into_iter().collect::<Vec<_>>(),
        vec![0, 1],
        "both virtqueues used"
    );
    r
}

#[test]
fn two_queues_use_the_batched_submit_path() {
    check_two_queues("guest-2q", GuestKernel::default());
}

#[test]
fn filters_keep_exactly_the_selected_pid_comm_cgroup_and_disk() {
    // comm: fio and dd both run; only dd is kept.
    let r = run_known_io("guest-filter-comm", "-c dd");
    let rqs = guest_rqs(&r);
    assert_eq!(rqs.len(), 50, "only dd's 50 reads");
    assert!(rqs.iter().all(|v| v.comm == "dd"));

    // disk: I/O on vda (ext4) and vdb; only vdb is kept.
    let wl = "set -e\n\
        dd if=/dev/zero of=/data/f bs=4k count=20 oflag=direct\n\
        dd if=/dev/vdb of=/dev/null bs=4k count=30 iflag=direct\n";
    let r = run_guest(
        "guest-filter-disk",
        VmConfig {
            guest_args: "-d vdb".into(),
            ..VmConfig::default()
        },
        wl,
    );
    let rqs = guest_rqs(&r);
    assert_eq!(rqs.len(), 30, "only vdb's 30 reads");
    assert!(rqs.iter().all(|v| v.disk == "vdb"));

    // cgroup and pid: three readers on distinct sector ranges; one inside cgroup `sel`, one
    // whose pid is given, one neither.
    let setup = "mkdir -p /sys/fs/cgroup/sel\n\
        sh -c 'echo $$ >/run/sel.pid; while [ ! -e /run/go ]; do sleep 0.05; done; \
        exec dd if=/dev/vdb of=/dev/null bs=4k count=11 skip=1000 iflag=direct' &\n\
        while [ ! -s /run/sel.pid ]; do sleep 0.05; done\n";
    let wl = "set -e\n\
        touch /run/go\n\
        sh -c 'echo $$ >/sys/fs/cgroup/sel/cgroup.procs; exec dd if=/dev/vdb of=/dev/null bs=4k count=7 skip=2000 iflag=direct'\n\
        dd if=/dev/vdb of=/dev/null bs=4k count=5 skip=3000 iflag=direct\n\
        while [ -e /proc/$(cat /run/sel.pid) ]; do sleep 0.05; done\n";
    for (name, args, count, first) in [
        (
            "guest-filter-cgroup",
            "--cgroup /sys/fs/cgroup/sel",
            7u64,
            2000u64,
        ),
        ("guest-filter-pid", "-p $(cat /run/sel.pid)", 11, 1000),
    ] {
        let r = run_guest(
            name,
            VmConfig {
                guest_args: args.into(),
                setup: Some(setup.into()),
                ..VmConfig::default()
            },
            wl,
        );
        let mut sectors: Vec<u64> = guest_rqs(&r).iter().map(|v| v.sector).collect();
        sectors.sort();
        let want: Vec<u64> = (0..count).map(|i| (first + i) * 8).collect();
        assert_eq!(
            sectors, want,
            "{name}: exactly the selected reader's requests"
        );
    }
}

#[test]
fn buffered_write_then_fsync_is_attributed_to_the_file_inode() {
    let wl = "set -e\n\
        dd if=/dev/urandom of=/data/wb.dat bs=4k count=64 conv=fsync\n\
        ls -i /data/wb.dat\n";
    let r = run_guest("guest-writeback", VmConfig::default(), wl);
    let log = r.workload_log();
    let inode: u64 = log
        .lines()
        .find(|l| l.contains("/data/wb.dat"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("inode not in workload log: {log}"));
    let bytes: u64 = guest_rqs(&r)
        .iter()
        .filter(|v| v.disk == "vda" && v.op == Op::Write && v.inode == inode)
        .map(|v| u64::from(v.bytes))
        .sum();
    assert_eq!(
        bytes,
        64 * 4096,
        "write-back bytes attributed to inode {inode}"
    );
}

// ---- Other guest kernels (issue 9): 5.10 (bullseye), 6.12 (trixie), newest 7.x (sid) ----

/// KNOWN_IO plus 20 random 4 KiB O_DIRECT reads through io_uring.
fn known_io_uring() -> (String, Shape) {
    let wl = format!(
        "{KNOWN_IO}fio --name=u --filename=/dev/vdb --rw=randread --bs=4k --direct=1 \
         --ioengine=io_uring --size=32M --number_ios=20 --randrepeat=0 --output=/dev/null\n"
    );
    let mut shape = known_io_shape();
    *shape.entry(("read".into(), 4096)).or_default() += 20;
    (wl, shape)
}

/// The points a mode cannot see on any kernel (no kernel-function hooks).
const TRACEPOINT_BLIND: &[&str] = &[
    "g.queue_rq",
    "g.vq_add",
    "g.kick",
    "g.irq",
    "g.driver_complete",
    "g.bio_complete",
];

/// The final stats line of guest.jsonl.
fn final_stats(r: &RunResult) -> Stats {
    let recs = r.records("guest.jsonl").expect("guest.jsonl");
    recs.stats()
        .filter(|s| s.is_final == Some(true))
        .cloned()
        .unwrap_or_else(|| panic!("no final stats line; log:\n{}", guest_log(r)))
}

/// Runs KNOWN_IO + io_uring on `kernel` with `args`; checks the exact requests, the mode the
/// agent ran in, that its blind-point report is exactly `blind`, and that the records carry
/// every guest point except those (where the kernel fires them) and none of those.
///
/// Kprobe mode may lose a request's driver points now and then (a kprobe that fires while
/// another BPF kprobe program runs is skipped by the kernel: 1 of 670 requests seen on 7.2),
/// so there `exact` is false: each point must be in all records but as many as the agent
/// counted skipped kprobe hits and program runs (`kprobe_hits_lost` + `bpf_runs_lost`, where
/// the kernel tells), else all but 1 %.
fn check_kernel_mode(
    name: &str,
    kernel: GuestKernel,
    args: &str,
    want_mode: &str,
    blind: &[&str],
    exact: bool,
) -> RunResult {
    let (wl, shape) = known_io_uring();
    let r = run_guest(
        name,
        VmConfig {
            guest_kernel: kernel,
            guest_args: args.into(),
            ..VmConfig::default()
        },
        &wl,
    );
    let stats = final_stats(&r);
    assert_eq!(stats.mode.as_deref(), Some(want_mode), "{}", guest_log(&r));
    assert_btf_mapped(&guest_log(&r));
    let reported: Vec<&str> = stats
        .blind_points
        .as_ref()
        .expect("blind_points")
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(reported, blind, "blind points on {}", r.kernel_release);
    let rqs = check_io(&r, blind.is_empty() && exact, &shape);
    // Kprobe hits and program runs the kernel skipped (counted where it can tell: 6.7+ and
    // 5.12+) bound the records that may lack a point; elsewhere 1 %.
    let c = stats.counters.clone().unwrap_or_default();
    let runs_lost = c.get("bpf_runs_lost").copied().unwrap_or(0) as usize;
    let lost = c
        .get("kprobe_hits_lost")
        .zip(c.get("bpf_runs_lost"))
        .map(|(a, b)| a + b);
    let need = match (exact, lost) {
        (true, _) => rqs.len(),
        (false, Some(n)) => rqs.len().saturating_sub(n as usize),
        (false, None) => rqs.len() - rqs.len() / 100,
    };
    // Every point not reported blind is in every record (g.rq_insert only where the
    // kernel's blk-mq inserts; 6.12+ issues directly), no reported one in any.
    for &pt in Point::ALL.iter().filter(|p| p.name().starts_with("g.")) {
        let p = pt.name();
        let n = rqs.iter().filter(|v| v.ts.get(pt).is_some()).count();
        if blind.contains(&p) {
            assert_eq!(n, 0, "{p} reported blind but seen");
        } else if !matches!(p, "g.rq_insert" | "g.syscall_exit") {
            // Program runs the kernel skipped (one would have nested in another on the
            // same CPU) are counted (bpf_runs_lost, 7.x): a record may lack a point only
            // if such a skipped run accounts for it (seen: 2 of 670 without g.bio_queue).
            let need = need.min(rqs.len().saturating_sub(runs_lost));
            assert!(n >= need, "{p} in {n} of {} records", rqs.len());
        }
    }
    if blind.is_empty() {
        let heads = rqs.iter().filter(|v| v.head.is_some()).count();
        assert!(heads >= need, "descriptor head in {heads} of {}", rqs.len());
    }
    // io_uring: each submission names its file offset (the tracepoint generation of this kernel).
    let recs = r.records("guest.jsonl").unwrap();
    let uring: Vec<_> = recs
        .guest_ios()
        .into_iter()
        .filter(|v| v.syscall == "io_uring_enter")
        .collect();
    // (a skipped program run, counted, may cost one)
    assert!(
        uring.len() <= 20 && uring.len() + runs_lost >= 20,
        "io_uring_enter records with requests: {} ({runs_lost} skipped runs)",
        uring.len()
    );
    for v in uring {
        assert_eq!(v.bytes, 4096, "{v:?}");
        assert_eq!(
            v.file_offset,
            v.requests.first().map(|q| q.sector * 512),
            "io_uring file offset = request sector × 512: {v:?}"
        );
    }
    r
}

#[test]
fn kernel_5_10_auto_mode_falls_back_to_kprobes_for_modules_and_sees_everything() {
    let r = check_kernel_mode(
        "guest-5.10-auto",
        GuestKernel::V5_10,
        "",
        "fentry",
        &[],
        true,
    );
    assert!(
        r.kernel_release.starts_with("5.10."),
        "{}",
        r.kernel_release
    );
    let log = guest_log(&r);
    assert!(
        log.contains("virtqueue_add_sgs: no BTF for virtio_ring"),
        "the kprobe fallback is reported: {log}"
    );
    // io_submit's wrapper takes an untyped struct pt_regs in 5.10's BTF: known
    // from the BTF, so the object loads once, with the syscall tracepoints.
    assert!(
        log.contains("__x64_sys_io_submit's struct pt_regs argument is untyped")
            && log.contains("in 1 attempt(s)"),
        "the untyped wrapper is planned around, not refused: {log}"
    );
}

#[test]
fn kernel_5_10_tracepoint_mode_reports_the_driver_points_blind() {
    check_kernel_mode(
        "guest-5.10-tracepoint",
        GuestKernel::V5_10,
        "--mode tracepoint",
        "tracepoint",
        TRACEPOINT_BLIND,
        true,
    );
}

#[test]
fn kernel_6_12_auto_mode_sees_everything() {
    let r = check_kernel_mode(
        "guest-6.12-auto",
        GuestKernel::V6_12,
        "",
        "fentry",
        &[],
        true,
    );
    assert!(
        r.kernel_release.starts_with("6.12."),
        "{}",
        r.kernel_release
    );
}

#[test]
fn kernel_7_auto_mode_sees_everything() {
    let r = check_kernel_mode("guest-7-auto", GuestKernel::V7, "", "fentry", &[], true);
    assert!(r.kernel_release.starts_with("7."), "{}", r.kernel_release);
}

#[test]
fn kernel_7_tracepoint_mode_reports_the_driver_points_blind() {
    check_kernel_mode(
        "guest-7-tracepoint",
        GuestKernel::V7,
        "--mode tracepoint",
        "tracepoint",
        TRACEPOINT_BLIND,
        true,
    );
}

#[test]
fn kernel_5_10_kprobe_mode_sees_everything() {
    check_kernel_mode(
        "guest-5.10-kprobe",
        GuestKernel::V5_10,
        "--mode kprobe",
        "kprobe",
        &[],
        false,
    );
}

#[test]
fn kernel_7_kprobe_mode_sees_everything() {
    let r = check_kernel_mode(
        "guest-7-kprobe",
        GuestKernel::V7,
        "--mode kprobe",
        "kprobe",
        &[],
        false,
    );
    // 7.x tells how many kprobe hits it skipped: the agent reports it as a loss counter.
    let stats = final_stats(&r);
    assert!(
        stats
            .counters
            .as_ref()
            .is_some_and(|c| c.contains_key("kprobe_hits_lost")),
        "{stats:?}"
    );
}

/// 7.x: virtio_queue_rqs(struct rq_list *), read through bpf_get_func_arg in fentry mode.
#[test]
fn kernel_7_two_queues_use_the_batched_submit_path() {
    let r = check_two_queues("guest-7-2q", GuestKernel::V7);
    let queued = vdb_rqs(&r)
        .iter()
        .filter(|v| v.ts.get(Point::QueueRq).is_some())
        .count() as u64;
    // The kernel skips a BPF program run that would nest in another on the same CPU
    // (2 vCPUs, interrupts during the submit path): such a request lacks g.queue_rq,
    // and the agent counts every skipped run. Every request has the point or is
    // accounted for by that counter (a lab run: 387 + 13 skipped).
    let stats = final_stats(&r);
    let skipped = stats
        .counters
        .as_ref()
        .and_then(|c| c.get("bpf_runs_lost").copied())
        .unwrap_or(0);
    assert!(
        queued + skipped >= 400 && skipped <= 20,
        "g.queue_rq on {queued} of 400 requests, {skipped} BPF runs skipped (counted)"
    );
    assert_eq!(stats.mode.as_deref(), Some("fentry"));
}

/// On 5.10 (no module BTF) the descriptor head is read at an assumed vring_virtqueue offset;
/// QEMU's own view of the same requests (host agent) proves it, with queue depth so heads vary.
/// QEMU throttles the drive (400 IOPS) so that fio's queue stays full however fast this
/// host completes a read: unthrottled, a slow TCG guest submits so slowly that QEMU has
/// finished each request before the next arrives, and only heads 0-3 were ever used.
#[test]
fn kernel_5_10_descriptor_heads_equal_qemus() {
    let wl = "set -e\n\
        fio --name=q --filename=/dev/vdb --rw=randread --bs=4k --direct=1 --ioengine=libaio \
        --iodepth=8 --size=32M --number_ios=300 --randrepeat=0 --output=/dev/null\n\
        fio --name=w --filename=/dev/vdb --rw=randwrite --bs=8k --direct=1 --ioengine=libaio \
        --iodepth=16 --size=32M --number_ios=200 --randrepeat=0 --output=/dev/null\n";
    let r = run_agents(
        "guest-5.10-heads",
        Agents::Both,
        VmConfig {
            guest_kernel: GuestKernel::V5_10,
            guest_args: "--mode kprobe".into(),
            // Both agents write their own records; no link is needed for this comparison.
            vsock: VsockMode::None,
            qemu_args: vec![
                "-set".into(),
                "drive.extra.throttling.iops-total=400".into(),
            ],
            ..VmConfig::default()
        },
        wl,
    );
    assert_eq!(r.guest_agent_rc, Some(0));
    let host = r.records("host.jsonl").unwrap();
    let mut qemu: std::collections::HashMap<(Op, u64, u32), Vec<(u16, u16)>> = Default::default();
    for v in host
        .host_elems()
        .into_iter()
        .filter(|v| v.device == "vextra")
    {
        qemu.entry((v.op, v.sector, v.bytes))
            .or_default()
            .push((v.queue, v.head));
    }
    let rqs = vdb_rqs(&r);
    assert_eq!(rqs.len(), 500, "300 reads + 200 writes");
    let mut heads = std::collections::BTreeSet::new();
    for v in &rqs {
        let qh = (v.queue.expect("queue"), v.head.expect("head"));
        heads.insert(qh.1);
        let seen = qemu
            .get(&(v.op, v.sector, v.bytes))
            .unwrap_or_else(|| panic!("QEMU never saw {v:?}"));
        assert!(seen.contains(&qh), "guest {qh:?}, QEMU {seen:?}: {v:?}");
    }
    // The writes keep 16 requests queued in QEMU's throttle: 16 heads at least.
    assert!(
        heads.len() >= 16,
        "queue depth 8-16 spreads the heads: {heads:?}"
    );
}

/// Always-on (no `--json`, no `-t`): the syscalls send no records, the kernel counts their
/// latencies (`io_hist`), and the syscall table still has every one of them.
#[test]
fn always_on_syscalls_are_counted_in_the_kernel_and_tabled() {
    check_always_on("guest-always-on", GuestKernel::default());
}

/// The same on 5.10 (kprobes for the driver, raw syscall tracepoints).
#[test]
fn kernel_5_10_always_on_syscalls_are_counted_in_the_kernel() {
    check_always_on("guest-5-10-always-on", GuestKernel::V5_10);
}

fn check_always_on(name: &str, kernel: GuestKernel) {
    let cfg = VmConfig {
        guest_json: false,
        guest_args: "-c fio".into(),
        guest_kernel: kernel,
        ..VmConfig::default()
    };
    let r = run_guest(name, cfg, KNOWN_IO);
    // Without --json the tables are the agent's standard output.
    let log = std::fs::read_to_string(r.path("guest.jsonl")).unwrap_or_default();
    let syscalls = totals_rows(&log, "syscalls");
    // fio's 300 writes and 300 reads, and a few reads of its own (4 on 6.1).
    assert_eq!(syscalls.get("pwrite64"), Some(&300), "{syscalls:?}\n{log}");
    let reads = syscalls.get("pread64").copied().unwrap_or(0);
    assert!((300..=310).contains(&reads), "{syscalls:?}\n{log}");
    // Every syscall was summarized, none sent a record, none was lost.
    let tabled: u64 = syscalls.values().sum();
    assert_eq!(counter(&log, "io_summarized"), tabled, "{log}");
    assert_eq!(counter(&log, "io_emitted"), 0, "{log}");
    assert_eq!(
        counter(&log, "io_hist_full") + counter(&log, "io_hist_reread"),
        0
    );
    // fio's requests on vdb are all still in the request table.
    assert_eq!(totals_rows(&log, "vdb").get("total"), Some(&600), "{log}");
}

#[test]
fn the_agent_reports_what_it_costs() {
    // The kernel measures BPF run time only when asked (it costs two clock reads a run).
    let cfg = VmConfig {
        setup: Some("echo 1 >/proc/sys/kernel/bpf_stats_enabled\n".into()),
        ..VmConfig::default()
    };
    let r = run_guest("guest-self-cost", cfg, KNOWN_IO);
    let c = final_stats(&r).counters.expect("counters");
    let get = |n: &str| *c.get(n).unwrap_or_else(|| panic!("no {n}: {c:?}"));
    let (cpu_us, peak_kib, bpf_ns) = (
        get("cost_cpu_us"),
        get("cost_peak_rss_kib"),
        get("cost_bpf_ns"),
    );
    // Its CPU covers the workload window the lab measured from /proc (10 ms ticks).
    let lab = r.metrics.guest_agent.as_ref().expect("lab's agent usage");
    assert!(
        lab.cpu_secs <= cpu_us as f64 / 1e6 + 0.02,
        "self-reported {cpu_us} µs < the lab's {} s over the workload",
        lab.cpu_secs
    );
    assert!(cpu_us > 0 && bpf_ns > 0, "{c:?}");
    // The verifier's work is most of the start-up (under TCG, about a second per 30k
    // instructions): a program whose paths multiply shows here first. With the chain
    // walk inlined in four programs it was about 560k; since its global functions, 73k.
    let insns = get("startup_verified_insns");
    assert!(
        (10_000..150_000).contains(&insns),
        "the verifier processed {insns} instructions at start-up"
    );
    assert!(get("startup_ms") > 0, "{c:?}");
    // Its peak is the kernel's high-water mark, later than the lab's reading.
    assert!(
        peak_kib >= lab.peak_rss_kib && peak_kib < 64 * 1024,
        "peak {peak_kib} KiB, the lab's {} KiB",
        lab.peak_rss_kib
    );
    let rqs = final_stats(&r).guest_rq.expect("guest_rq");
    let log = guest_log(&r);
    let line = log
        .lines()
        .find(|l| l.contains("cost while tracing:"))
        .unwrap_or_else(|| panic!("no cost line: {log}"));
    assert!(
        line.contains(&format!("per request ({rqs} requests)")) && line.contains("BPF run time"),
        "{line}"
    );
}
