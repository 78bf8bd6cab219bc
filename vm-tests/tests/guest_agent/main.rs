//! End-to-end tests of the guest agent (issue 3) in real guests; those on the other guest
//! kernels are in `kernels.rs`.

use viotrace_shared::record::{GuestRq, Op, Point, Points, Stats};
use viotrace_vm_tests::assets::GuestKernel;
use viotrace_vm_tests::{Agents, RunResult, VmConfig};

#[path = "../common/mod.rs"]
mod common;
mod kernels;
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
    // ... and each is counted as such (any disk's)
    let issue_unseen = final_stats(r)
        .counters
        .and_then(|c| c.get("rq_issue_unseen").copied());
    if with_virtio {
        assert!(
            issue_unseen.is_some_and(|n| n as usize >= without_issue),
            "{without_issue} records without g.rq_issue, rq_issue_unseen {issue_unseen:?}"
        );
    }
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

/// Without MSI-X (`vectors=0`: the disks interrupt on shared INTx lines, whose
/// handler is virtio-pci's `vp_interrupt`, not `vring_interrupt`), g.irq still
/// comes from the irq tracepoint, keyed by the device: every request has it.
#[test]
fn fentry_mode_takes_g_irq_from_a_shared_intx_interrupt_too() {
    let cfg = VmConfig {
        guest_args: "--mode fentry".into(),
        qemu_args: vec!["-global".into(), "virtio-blk-pci.vectors=0".into()],
        ..VmConfig::default()
    };
    let wl = format!("grep -i virtio /proc/interrupts > /out/irqs.txt\n{KNOWN_IO}");
    let r = run_guest("guest-fentry-intx", cfg, &wl);
    let irqs = std::fs::read_to_string(r.path("irqs.txt")).unwrap_or_default();
    // (the two disks; the other virtio devices keep MSI-X)
    assert!(
        irqs.matches("IO-APIC").count() >= 2,
        "the disks not on INTx: {irqs}"
    );
    check_fentry_run(&r);
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
    // Each names /dev/vdb's inode (one for all) and the offset its request read
    // or wrote: pread64/pwrite64 from the argument, dd's read() from the file's
    // position (in fentry mode both typed at vfs_read/vfs_write: for a thread's
    // first syscall from its entry's note, as it has no state yet).
    let inode = ios.first().map(|io| io.inode).unwrap_or(0);
    assert!(inode != 0, "{:?}", ios.first());
    for io in &ios {
        assert_eq!(io.requests.len(), 1, "{io:?}");
        assert!(
            io.ts.get(Point::SyscallEnter).is_some() && io.ts.get(Point::SyscallExit).is_some()
        );
        assert_eq!(io.inode, inode, "{io:?}");
        assert_eq!(io.file_offset, Some(io.requests[0].sector * 512), "{io:?}");
    }
    // dd's writes to /dev/null (a character device: not file I/O) send no
    // record, though its thread has a state by then (from its reads).
    let dd_writes: Vec<_> = recs
        .guest_ios()
        .into_iter()
        .filter(|v| v.comm == "dd" && v.syscall == "write")
        .collect();
    assert!(
        dd_writes.is_empty(),
        "records of dd's writes to /dev/null: {dd_writes:?}"
    );
    let counters = final_stats(r).counters.unwrap_or_default();
    for c in ["syscall_file_unseen", "syscall_entry_lost"] {
        assert_eq!(counters.get(c), Some(&0), "{c}: {counters:?}");
    }
    // The agent is honest about what it sees, and says where g.kick comes from.
    let log = guest_log(r);
    assert!(log.to_lowercase().contains("fentry"), "{log}");
    assert_btf_mapped(&log);
    assert!(
        log.contains("g.kick: when virtqueue_kick_prepare returned"),
        "{log}"
    );
    // g.irq from the irq tracepoint (tb_irq_entry), not a fallback to vring_interrupt's
    // trampoline: a fallback says so.
    assert!(!log.contains("g.irq:"), "{log}");
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

/// A syscall that causes more requests than its record lists (16; here 26 of
/// 1280 KiB, virtio-blk's largest) says how many it left out, and the agent
/// counts them.
#[test]
fn a_syscall_of_many_requests_lists_sixteen_and_counts_the_rest() {
    let wl = "set -e\ndd if=/dev/vdb of=/dev/null bs=32M count=1 iflag=direct\n";
    let r = run_guest("guest-many-requests", VmConfig::default(), wl);
    let recs = r.records("guest.jsonl").unwrap();
    let dd_rqs: Vec<_> = recs
        .guest_rqs()
        .into_iter()
        .filter(|q| q.disk == "vdb" && q.comm == "dd")
        .collect();
    let bytes: u64 = dd_rqs.iter().map(|q| u64::from(q.bytes)).sum();
    assert_eq!(bytes, 32 << 20, "dd's vdb requests: {}", dd_rqs.len());
    let read = recs
        .guest_ios()
        .into_iter()
        .find(|io| io.comm == "dd" && io.syscall == "read" && io.bytes == 32 << 20)
        .unwrap_or_else(|| panic!("no record of dd's read; log:\n{}", guest_log(&r)));
    assert!(
        dd_rqs.len() > 16,
        "{} requests: not enough to cut",
        dd_rqs.len()
    );
    assert_eq!(read.requests.len(), 16, "{read:?}");
    assert_eq!(
        read.requests.len() + read.requests_unlisted as usize,
        dd_rqs.len(),
        "{read:?}"
    );
    for q in &read.requests {
        assert!(
            dd_rqs
                .iter()
                .any(|d| d.sector == q.sector && d.bytes == q.bytes),
            "listed {q:?} is none of dd's requests"
        );
    }
    let counters = final_stats(&r).counters.unwrap_or_default();
    assert!(
        counters.get("io_refs_truncated").is_some_and(|&n| n >= 1),
        "{counters:?}"
    );
}

/// The final stats line of guest.jsonl.
fn final_stats(r: &RunResult) -> Stats {
    let recs = r.records("guest.jsonl").expect("guest.jsonl");
    recs.stats()
        .filter(|s| s.is_final == Some(true))
        .cloned()
        .unwrap_or_else(|| panic!("no final stats line; log:\n{}", guest_log(r)))
}

/// Threads that exit give their syscall slots back: 1 500 short-lived dd processes (as many
/// thread ids, more than the 1 024 slots) each read one block of vdb. Each finds the slot of
/// its thread id free (a dd before it freed it), so hardly any state goes to the hash map
/// (before 2026-12-07 a slot was held for good: about 480 would have); every read has its
/// record, with its request and its offset, though its thread had no state at its entry.
#[test]
fn exited_threads_give_back_their_syscall_slots() {
    const N: u64 = 1500;
    let workload = format!(
        "i=0\nwhile [ $i -lt {N} ]; do dd if=/dev/vdb of=/dev/null bs=4k count=1 skip=$i \
         iflag=direct status=none; i=$((i+1)); done\n"
    );
    let cfg = VmConfig {
        guest_args: "--mode fentry".into(),
        ..VmConfig::default()
    };
    let r = run_guest("guest-exited-threads", cfg, &workload);
    let recs = r.records("guest.jsonl").unwrap();
    let reads: Vec<_> = recs
        .guest_ios()
        .into_iter()
        .filter(|v| v.comm == "dd" && v.syscall == "read")
        .filter(|v| v.requests.iter().any(|q| q.disk == "vdb"))
        .collect();
    let mut offsets: Vec<u64> = reads.iter().filter_map(|io| io.file_offset).collect();
    offsets.sort_unstable();
    assert_eq!(offsets, (0..N).map(|i| i * 4096).collect::<Vec<_>>());
    let tids: std::collections::BTreeSet<u32> = reads.iter().map(|io| io.tid).collect();
    assert_eq!(tids.len() as u64, N, "one thread per dd");
    let counters = final_stats(&r).counters.unwrap_or_default();
    let hashed = counters.get("syscall_states_hashed").copied();
    assert!(hashed.is_some_and(|h| h < 50), "{counters:?}");
    assert_eq!(counters.get("syscall_entry_lost"), Some(&0), "{counters:?}");
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
    // Its peak is the kernel's high-water mark, later than the lab's reading, or
    // the RSS the page tables hold (smaps_rollup) if higher, as the lab's is (before
    // 6.2 the high-water mark lags): two moments a few pages apart.
    const SLACK_KIB: u64 = 512;
    assert!(
        peak_kib + SLACK_KIB >= lab.peak_rss_kib && peak_kib < 64 * 1024,
        "peak {peak_kib} KiB, the lab's {} KiB",
        lab.peak_rss_kib
    );
    // No transparent huge page can inflate it (khugepaged collapsing the heap).
    let status = std::fs::read_to_string(r.path("guest-agent.end.status")).unwrap();
    assert!(status.contains("THP_enabled:\t0"), "{status}");
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

/// `--skip-points lean`: its points' programs are left out and said so; every
/// request is still recorded, on its virtqueue with its descriptor head (the join
/// key), attributed to its task (check_known_io), with nothing counted lost.
#[test]
fn lean_points_leave_their_programs_out_and_keep_every_request_and_its_head() {
    let r = run_known_io("guest-lean", "--mode fentry --skip-points lean");
    let rqs = check_known_io(&r, false);
    let skipped = common::LEAN_POINTS;
    for v in &rqs {
        assert!(v.head.is_some_and(|h| h < 256), "head: {v:?}");
        assert_eq!(v.queue, Some(0), "{v:?}");
        assert_eq!(v.kicked, None, "{v:?}");
        for p in [
            Point::BioQueue,
            Point::RqInsert,
            Point::VqAdd,
            Point::RqComplete,
        ] {
            assert!(v.ts.get(p).is_some(), "{p} missing in {v:?}");
        }
        for p in skipped {
            assert!(v.ts.get(p).is_none(), "{p} in {v:?}");
        }
    }
    let stats = final_stats(&r);
    let names: Vec<String> = skipped.iter().map(|p| p.name().to_string()).collect();
    assert_eq!(stats.blind_points, Some(names));
    let c = stats.counters.expect("counters");
    // the kick ring is not used: no request waits for a kick that never comes
    for n in ["kick_after_completion", "kick_slot_lost", "ringbuf_drop_rq"] {
        assert_eq!(c.get(n).copied().unwrap_or(0), 0, "{n}: {c:?}");
    }
    let log = guest_log(&r);
    for why in [
        "left out (--skip-points g.kick)",
        "g.driver_complete: left out (--skip-points g.driver_complete)",
        "g.bio_complete: left out (--skip-points g.bio_complete)",
    ] {
        assert!(log.contains(why), "{why}: {log}");
    }
}
