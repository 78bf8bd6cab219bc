//! End-to-end tests of the host agent (issue 4): stock QEMU traced from the host.

use std::collections::{BTreeMap, BTreeSet};

use viotrace_shared::record::{Backend, HostElem, Op, Point};
use viotrace_vm_tests::assets::QemuBuild;
use viotrace_vm_tests::records::Records;
use viotrace_vm_tests::{Agents, Aio, DiskFormat, HostAttach, RunResult, VmConfig};

mod common;
use common::checks::{elems, known_io_device};
use common::http::{free_port, Scraper};
use common::{host, lab, lab_lock, out_dir, run_agents, KNOWN_IO};

fn run_host(name: &str, cfg: VmConfig, workload: &str) -> RunResult {
    let r = run_agents(name, Agents::Host, cfg, workload);
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert_eq!(r.workload_rc, 0, "workload failed:\n{}", r.workload_log());
    assert_eq!(
        r.host_agent_rc,
        Some(0),
        "host agent exit status; log:\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    r
}

/// `run_host` on the known workload with one offset of this VM's layout
/// overridden through the agent's test hook (scoped to the VM's name, `vt-NAME`:
/// other tests' VMs are not affected); the result and the agent's log.
fn run_with_layout_override(name: &str, spec: &str, host_args: &[&str]) -> (RunResult, String) {
    let r = run_host(
        name,
        VmConfig {
            host_env: vec![(
                "VIOTRACE_HOST_LAYOUT_OVERRIDE".into(),
                format!("vt-{name}:{spec}"),
            )],
            host_args: host_args.iter().map(|a| a.to_string()).collect(),
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    (r, log)
}

/// Host elements the run's agent recorded.
fn host_elem_count(r: &RunResult) -> usize {
    r.records("host.jsonl")
        .expect("host.jsonl")
        .host_elems()
        .len()
}

fn check_known_io(r: &RunResult, backend: Backend) {
    check_known_io_kicked(r, backend, true)
}

/// `check_known_io`; `kicked`: the guest kicks for each request (an IOThread polls the
/// ring instead, and the guest's kicks stay off while it does: no h.notify then).
fn check_known_io_kicked(r: &RunResult, backend: Backend, kicked: bool) {
    let all = elems(r);
    let recs = known_io_device(&all);
    let mut dd = Vec::new();
    for v in &recs {
        assert_eq!(v.backend, backend, "{v:?}");
        assert_eq!(v.queue, 0, "{v:?}");
        assert!(v.head < 256, "{v:?}");
        assert_eq!(v.qemu_pid, r.qemu_pid, "{v:?}");
        let sector = v.sector;
        if v.bytes == 65536 {
            dd.push(sector);
        } else {
            assert!(sector % 8 == 0 && sector * 512 < 32 << 20, "{v:?}");
        }
        // h.pop needs the optional virtqueue_pop uprobe (--pop); h.notify is the kick handling.
        let pop = v.ts.get(Point::HostPop).or(v.ts.get(Point::HostNotify));
        let pop = match (pop, kicked) {
            (Some(t), _) => t,
            (None, false) => v.ts.get(Point::HostSubmit).unwrap_or_default(),
            (None, true) => panic!("h.pop or h.notify: {v:?}"),
        };
        let push =
            v.ts.get(Point::HostPush)
                .unwrap_or_else(|| panic!("h.push: {v:?}"));
        assert!(pop > 0 && pop <= push, "{v:?}");
        // Every request here is a read or a write: h.submit (QEMU's block
        // accounting start by default, the blk_aio_* call with --submit) lies
        // between the kick handling and the host I/O.
        let submit =
            v.ts.get(Point::HostSubmit)
                .unwrap_or_else(|| panic!("h.submit: {v:?}"));
        let io = v.ts.get(Point::HostIoIssue).unwrap_or(push);
        assert!(pop <= submit && submit <= io, "{v:?}");
        for (k, t) in v.ts.iter() {
            assert!(k.name().starts_with("h.") && t > 0, "{v:?}");
        }
    }
    dd.sort();
    assert_eq!(dd, (0..50).map(|i| i * 128).collect::<Vec<u64>>());
}

#[test]
fn threads_backend_one_record_per_element() {
    let r = run_host("host-threads", VmConfig::default(), KNOWN_IO);
    check_known_io(&r, Backend::Threads);
    // QEMU 7.2's virtqueue_push starts with push %r12, which the kernel emulates: no
    // endbr64 to skip.
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert!(!log.contains("endbr64"), "{log}");
    // QEMU 7.2 notifies the guest through the queue's irqfd (an eventfd write, seen by a
    // tracepoint): its virtio_notify traps are other devices' (the console), told apart
    // from the requests' own (the bench counts traps per request with them).
    let v = host::final_stats(&r.out_dir).values;
    assert_eq!(v["virtio_notify_traced"], 0, "{v:?}");
    assert!(v["guest_notifications"] >= 650, "{v:?}");
}

#[test]
fn native_aio_backend() {
    let r = run_host(
        "host-native",
        VmConfig {
            aio: Aio::Native,
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    check_known_io(&r, Backend::Native);
}

#[test]
fn io_uring_backend() {
    let r = run_host(
        "host-io-uring",
        VmConfig {
            aio: Aio::IoUring,
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    check_known_io(&r, Backend::IoUring);
}

#[test]
fn qcow2_image() {
    let r = run_host(
        "host-qcow2",
        VmConfig {
            format: DiskFormat::Qcow2,
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    check_known_io(&r, Backend::Threads);
}

/// QEMU's multireq merge, followed at the push of a merged request's head
/// (default: one trap per request) and at its submit (--submit): every merged
/// element shares the backend I/O and has its host I/O points.
#[test]
fn merged_sequential_writes_share_a_merge_id() {
    check_merged("host-merge", Vec::new());
    check_merged("host-merge-submit", vec!["--submit".into()]);
}

fn check_merged(name: &str, host_args: Vec<String>) {
    // The guest must not merge them itself, so QEMU's multireq merge does.
    let wl = "set -e\n\
        echo 2 >/sys/block/vdb/queue/nomerges\n\
        fio --name=seq --filename=/dev/vdb --rw=write --bs=4k --direct=1 --ioengine=libaio \
        --iodepth=16 --iodepth_batch_submit=16 --size=4M --output=/dev/null\n";
    let cfg = VmConfig {
        host_args,
        ..VmConfig::default()
    };
    let r = run_host(name, cfg, wl);
    let all = elems(&r);
    let writes: Vec<&HostElem> = all
        .iter()
        .filter(|v| v.op == Op::Write && v.bytes == 4096)
        .collect();
    assert!(
        writes.len() >= 1024,
        "4 MiB in 4 KiB writes: {}",
        writes.len()
    );
    let mut groups: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for v in &writes {
        groups.entry(v.merge_id).or_default().push(v.sector);
    }
    let merged: Vec<&Vec<u64>> = groups.values().filter(|g| g.len() > 1).collect();
    assert!(
        !merged.is_empty(),
        "no merged backend I/O among {} groups",
        groups.len()
    );
    for g in &merged {
        let mut s = (*g).clone();
        s.sort();
        for w in s.windows(2) {
            assert_eq!(
                w[1],
                w[0] + 8,
                "{name}: merged elements are contiguous: {s:?}"
            );
        }
    }
    let in_merges: Vec<&&HostElem> = writes
        .iter()
        .filter(|v| v.merge_id != 0 && groups[&v.merge_id].len() > 1)
        .collect();
    let with_io = in_merges
        .iter()
        .filter(|v| v.ts.get(Point::HostIoIssue).is_some() && v.ts.get(Point::HostSubmit).is_some())
        .count();
    eprintln!(
        "{name}: {} writes, {} merged groups, {} merged elements, {with_io} with h.submit and host I/O",
        writes.len(),
        merged.len(),
        in_merges.len()
    );
    assert_eq!(
        with_io,
        in_merges.len(),
        "{name}: merged elements without host I/O"
    );
}

#[test]
fn agent_started_before_qemu_discovers_it() {
    let wl = format!("sleep 3\n{KNOWN_IO}");
    let port = free_port();
    let scraper = Scraper::start(port, "/metrics");
    let r = run_host(
        "host-before",
        VmConfig {
            host_attach: HostAttach::BeforeQemu,
            // Discovery follows only this VM (other QEMUs may run on the machine).
            host_args: vec![
                "--vm".into(),
                "vt-host-before".into(),
                "--metrics-listen".into(),
                format!("127.0.0.1:{port}"),
            ],
            ..VmConfig::default()
        },
        &wl,
    );
    let scraped = scraper.finish().expect("the metrics endpoint answered");
    check_known_io(&r, Backend::Threads);
    // Discovery waited for the kernel to see a QEMU start: one scan at the
    // start, one per QEMU exec, one per 30 s, not one a second.
    let c = viotrace_vm_tests::bench::final_counters(&r, "host");
    let counter = |name: &str| {
        *c.get(name)
            .unwrap_or_else(|| panic!("no {name} in the host's counters: {c:?}"))
    };
    let (execs, scans) = (counter("qemu_execs"), counter("discovery_scans"));
    assert!(execs >= 1, "the VM's QEMU exec was seen: {c:?}");
    let bound = 1 + execs + r.total_secs as u64 / 30;
    assert!(
        scans <= bound,
        "{scans} discovery scans in {:.0} s (at most {bound}): {c:?}",
        r.total_secs
    );
    // The metrics endpoint publishes the discovery mode's counters too (one list
    // for the stats line and the endpoint, since b5b267a).
    for name in ["discovery_scans", "qemu_execs", "startup_verified_insns"] {
        let series = format!("name=\"{name}\"}} ");
        let v: u64 = scraped
            .lines()
            .find_map(|l| l.split_once(&series).map(|(_, v)| v.trim()))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in the scraped metrics:\n{scraped}"));
        assert!(v >= 1, "{name} = {v} in the scraped metrics");
    }
    // The verifier's work is reported, and the largest program keeps most of the
    // kernel's 1 M limit free (on 6.18.44 `push` once went past it: not loadable).
    let (verified, top) = (
        counter("startup_verified_insns"),
        counter("startup_verified_insns_max"),
    );
    assert!(
        top > 0 && top <= verified && top <= 500_000,
        "largest program: {top} of {verified} verified instructions (limit 1 M)"
    );
    // What the agent says it cost covers what the lab measured over the workload
    // (from /proc; 10 ms ticks), and its peak RSS is the kernel's high-water mark.
    let lab = r
        .metrics
        .host_agent
        .as_ref()
        .expect("lab's host agent usage");
    let (cpu_us, peak_kib) = (counter("cost_cpu_us"), counter("cost_peak_rss_kib"));
    assert!(
        cpu_us > 0 && lab.cpu_secs <= cpu_us as f64 / 1e6 + 0.02,
        "self-reported {cpu_us} µs, the lab's {} s over the workload",
        lab.cpu_secs
    );
    // The two readings are the kernel's high-water mark at two moments (the
    // lab's at the workload's end, the agent's at its stop), built from RSS
    // counters that are per-CPU and approximate by some pages each (2026-11-29:
    // 11 564 KiB self-reported against the lab's 11 632, once the agent's peak
    // was no longer its start-up but the end of the run).
    const SLACK_KIB: u64 = 512;
    assert!(
        peak_kib + SLACK_KIB >= lab.peak_rss_kib && peak_kib < 256 * 1024,
        "peak {peak_kib} KiB, the lab's {} KiB",
        lab.peak_rss_kib
    );
    // No transparent huge page can inflate it (khugepaged collapsing the heap).
    let status = std::fs::read_to_string(r.path("host-agent.end.status")).unwrap();
    assert!(status.contains("THP_enabled:\t0"), "{status}");
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default()
        + &std::fs::read_to_string(r.path("host.jsonl")).unwrap_or_default();
    assert!(
        log.contains("viotrace-host: cost while tracing:"),
        "no cost line: {log}"
    );
}

#[test]
fn agent_attaches_to_a_running_vm_without_disturbing_it() {
    // fio verifies its data, so a disturbed guest I/O would fail the workload.
    let wl = "set -e\n\
        fio --name=v --filename=/dev/vdb --rw=randwrite --bs=4k --direct=1 --ioengine=psync \
        --size=32M --runtime=6 --time_based --verify=crc32c --do_verify=1 --verify_fatal=1 \
        --output=/dev/null\n\
        dd if=/dev/vdb of=/dev/null bs=4k count=100 skip=10000 iflag=direct\n";
    let r = run_host(
        "host-running",
        VmConfig {
            host_attach: HostAttach::Running,
            ..VmConfig::default()
        },
        wl,
    );
    let all = elems(&r);
    let reads: BTreeSet<u64> = all
        .iter()
        .filter(|v| v.op == Op::Read && v.bytes == 4096)
        .map(|v| v.sector)
        .filter(|s| (80_000..80_800).contains(s))
        .collect();
    assert_eq!(
        reads.len(),
        100,
        "dd's reads (beyond fio's 32 MiB) after the attach are all seen"
    );
}

/// The runtime layout check: one offset of this VM's layout is corrupted through
/// the agent's test hook (VirtIOBlockReq.out read 8 bytes late, so a heap pointer
/// is taken for the sector). The agent refuses the layout with a message naming
/// the field, emits none of the garbage, stops tracing the VM and keeps running.
#[test]
fn corrupted_layout_is_refused_naming_the_field() {
    let (r, log) = run_with_layout_override("host-refuse", "req_out=0x90", &[]);
    assert!(log.contains("TEST OVERRIDE"), "{log}");
    assert!(
        log.contains("layout REFUSED: VirtIOBlockReq.out looks wrong"),
        "{log}"
    );
    assert!(log.contains("(layout refused)"), "{log}");
    let host = r.records("host.jsonl").expect("host.jsonl");
    let recs = host.host_elems();
    assert!(
        recs.is_empty(),
        "no record of a refused layout: {:?}",
        recs.first()
    );
    // Dropped, and counted.
    assert!(
        log.contains("records of the refused layout dropped"),
        "{log}"
    );
    let last = host.stats().expect("stats");
    assert!(
        last.values.get("refused_layout_records_dropped") >= Some(&1),
        "{last:?}"
    );
    // The agent ran on to the end of the workload and stopped cleanly (run_host
    // checks its exit status).
    assert!(log.contains("totals over"), "{log}");
}

/// The BPF side of the check: with VirtIOBlockReq.vq read at a wrong offset no
/// request's queue belongs to its device, so no element is ever tracked; after 64
/// such requests the layout is refused naming the request's queue field.
#[test]
fn corrupted_request_queue_offset_is_refused() {
    // VirtIOBlockReq.vq is read at blk_aio_* (--submit); at virtqueue_push the
    // queue is the function's own argument.
    let (r, log) = run_with_layout_override("host-refuse-vq", "req_vq=0x50", &["--submit"]);
    assert!(
        log.contains("layout REFUSED: VirtIOBlockReq.vq looks wrong: on all"),
        "{log}"
    );
    assert!(log.contains("(layout refused)"), "{log}");
    assert_eq!(host_elem_count(&r), 0);
}

/// Push-only mode with VirtIOBlockReq.dev read at a wrong offset: no element's
/// device is its queue's, so none is taken (other devices' elements fail that
/// check too, so it cannot refuse); the agent says so instead of staying silent.
#[test]
fn corrupted_device_offset_is_reported_in_push_mode() {
    let (r, log) = run_with_layout_override("host-warn-dev", "req_dev=0x50", &[]);
    assert!(
        log.contains("virtqueue_push calls and none of a virtio-blk request"),
        "{log}"
    );
    assert_eq!(host_elem_count(&r), 0);
}

/// LTO builds (Ubuntu) inline blk_aio_* into their callers, so uprobes there never
/// fire. Treated as such through the agent's test hook, `--submit` cannot trap
/// them: every element is still recorded, taken at virtqueue_push (op, sector,
/// bytes from the element, h.submit from QEMU's block accounting), as by default.
#[test]
fn fallback_without_blk_aio_call_sites_keeps_records_complete() {
    let r = run_host(
        "host-lto",
        VmConfig {
            host_env: vec![(
                "VIOTRACE_HOST_ASSUME_INLINED".into(),
                "vt-host-lto:blk_aio_preadv,blk_aio_pwritev,blk_aio_flush".into(),
            )],
            host_args: vec!["--submit".into()],
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert!(
        log.contains("--submit: blk_aio_preadv/pwritev are not probeable"),
        "{log}"
    );
    check_known_io(&r, Backend::Threads);
    let all = elems(&r);
    let recs = known_io_device(&all);
    // Host I/O found by the element's data buffer (psync and dd: no merging).
    let with_io = recs
        .iter()
        .filter(|v| {
            v.ts.get(Point::HostIoIssue).is_some() && v.ts.get(Point::HostIoComplete).is_some()
        })
        .count();
    assert_eq!(with_io, recs.len(), "every element has its host I/O");
}

/// --pop: h.pop from virtqueue_pop (uprobe + uretprobe on Debian's build, the USDT
/// probe on dtrace-backend builds), before the element's submit (--submit: the
/// blk_aio_* call).
#[test]
fn pop_probe_gives_h_pop() {
    check_pop_submit("host-pop", QemuBuild::default());
}

/// The same on bookworm-backports' QEMU 10.0, whose probe targets start as 7.2's.
#[test]
fn qemu_10_0_pop_and_submit_on_emulated_sites() {
    check_pop_submit("host-pop-10.0", QemuBuild::V10_0);
}

/// `--pop --submit` on `qemu`: exact KNOWN_IO records, h.pop before h.submit on
/// each, and the probes on the sites of Debian's 7.2 and 10.0 builds.
fn check_pop_submit(name: &str, qemu: QemuBuild) {
    let r = run_host(
        name,
        VmConfig {
            qemu,
            host_args: vec!["--pop".into(), "--submit".into()],
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    check_known_io(&r, Backend::Threads);
    // virtqueue_pop starts with a movabs and blk_aio_preadv with a sub: probed
    // there, each hit would take a single-step. The probes sit on the first
    // instruction the kernel emulates that still sees the arguments.
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    let placed = assert_sites(
        &log,
        &[
            "virtqueue_pop +0x15 (jne)",
            "blk_aio_preadv +0xb (js)",
            "blk_aio_pwritev +0xb (js)",
            "blk_aio_flush +0x10 (push)",
        ],
    );
    assert!(!placed.contains("virtqueue_push"), "{placed}");
    let stepped = log
        .lines()
        .find(|l| l.contains("uprobes single-stepped"))
        .unwrap_or_default();
    assert!(
        !stepped.contains("virtqueue_pop") && !stepped.contains("preadv"),
        "{stepped}"
    );
    let all = elems(&r);
    for v in known_io_device(&all) {
        let pop =
            v.ts.get(Point::HostPop)
                .unwrap_or_else(|| panic!("h.pop: {v:?}"));
        let submit =
            v.ts.get(Point::HostSubmit)
                .unwrap_or_else(|| panic!("h.submit: {v:?}"));
        assert!(pop <= submit, "{v:?}");
    }
}

/// The host agent log's line of uprobes placed past their entry, which names
/// each of `sites` ("virtqueue_pop +0x15 (jne)").
fn assert_sites<'a>(log: &'a str, sites: &[&str]) -> &'a str {
    let placed = log
        .lines()
        .find(|l| l.contains("uprobes placed past their entry"))
        .unwrap_or_else(|| panic!("no placement line:\n{log}"));
    for site in sites {
        assert!(placed.contains(site), "{site}: {placed}");
    }
    placed
}

/// The attach line of the host agent's log for the VM.
fn attach_line(r: &RunResult) -> String {
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    log.lines()
        .find(|l| l.contains("viotrace-host: tracing pid"))
        .unwrap_or_else(|| panic!("no attach line:\n{log}"))
        .to_string()
}

/// bookworm-backports' QEMU 10.0 (Debian 13's line): the 10.0 layout, its VirtQueue
/// offsets and VirtIOBlock.blk confirmed from the binary's code, exact KNOWN_IO
/// records, with the io_uring backend (its SQE copy is at the 10.0 offset).
#[test]
fn qemu_10_0_exact_records() {
    let r = run_host(
        "host-qemu-10.0",
        VmConfig {
            qemu: QemuBuild::V10_0,
            aio: Aio::IoUring,
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    assert!(r.qemu_version.starts_with("10.0."), "{}", r.qemu_version);
    let line = attach_line(&r);
    assert!(line.contains("layout of QEMU 10.0-10.1"), "{line}");
    assert!(line.contains("VirtIOBlock.blk"), "{line}");
    assert!(!line.contains("not confirmed"), "{line}");
    check_known_io(&r, Backend::IoUring);
    let all = elems(&r);
    let recs = known_io_device(&all);
    let with_io = recs
        .iter()
        .filter(|v| v.ts.get(Point::HostIoIssue).is_some())
        .count();
    assert_eq!(with_io, recs.len(), "io_uring SQEs matched on 10.0");
    for v in &recs {
        assert_eq!(v.device, "vextra", "{v:?}");
    }
    // Served by the main loop, 10.0 raises the interrupt in virtio_notify, without the
    // guest notifier eventfd. By default that is not trapped: one uprobe hit per block
    // request (the pushes of other devices' queues aside), and the records have no h.irq,
    // each counted as such. `--irq` traps it (qemu_11_from_its_root_exact_records).
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert!(
        log.contains("h.irq only on queues whose guest notifier eventfd QEMU writes"),
        "{log}"
    );
    let v = host::final_stats(&r.out_dir).values;
    assert_eq!(v["virtio_notify_calls"], 0, "{v:?}");
    assert_eq!(v["guest_notifications"], 0, "{v:?}");
    assert!(v["irq_untraced"] >= 650, "{v:?}");
    assert_eq!(v["irq_untraced"], v["records_emitted"], "{v:?}");
    assert_eq!(
        v["uprobe_hits"] - v["push_other_device"],
        v["records_emitted"],
        "{v:?}"
    );
    assert!(recs.iter().all(|e| e.ts.get(Point::HostIrq).is_none()));
}

/// The same QEMU 10.0 with its disks served by an IOThread (as libvirt's `<driver
/// iothread=…>`): there it notifies the guest through the queue's guest notifier eventfd,
/// which a kernel tracepoint sees. Exact records, every one with h.irq (the queue's first
/// push after the agent attached may lack it, counted), one uprobe hit per block request.
/// (The IOThread polls the ring, so most requests come without a kick: no h.notify.)
#[test]
fn qemu_10_0_iothread_irq_from_the_eventfd() {
    let r = run_host(
        "host-qemu-10.0-iothread",
        VmConfig {
            qemu: QemuBuild::V10_0,
            iothread: true,
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    assert!(r.qemu_version.starts_with("10.0."), "{}", r.qemu_version);
    check_known_io_kicked(&r, Backend::Threads, false);
    let all = elems(&r);
    let recs = known_io_device(&all);
    let no_irq = recs
        .iter()
        .filter(|e| e.ts.get(Point::HostIrq).is_none())
        .count();
    assert!(no_irq <= 1, "{no_irq} of {} without h.irq", recs.len());
    for e in &recs {
        if let (Some(push), Some(irq)) = (e.ts.get(Point::HostPush), e.ts.get(Point::HostIrq)) {
            assert!(push <= irq, "{e:?}");
        }
    }
    let v = host::final_stats(&r.out_dir).values;
    assert_eq!(v["virtio_notify_calls"], 0, "{v:?}");
    assert!(v["guest_notifications"] >= 100, "{v:?}");
    // One record per push: emitted by BPF at h.irq, or by the agent's sweep of
    // pushed elements whose notification never came (a queue's first).
    assert_eq!(
        v["uprobe_hits"] - v["push_other_device"],
        v["records_emitted"] + v["emitted_without_notification"],
        "{v:?}"
    );
}

/// sid's QEMU 11.x run from its own root (a private mount namespace pivoted into a
/// debootstrapped sid: the containerised case). /proc/PID/exe names
/// /usr/bin/qemu-system-x86_64, which here is another binary (the host's 7.2): the
/// agent reads and probes it through /proc/PID/root. 11.x's layout is not from a
/// measured tree: the runtime check decides, and the records are exact (with
/// `--pop --submit` too: their probes on sid's sites).
#[test]
fn qemu_11_from_its_root_exact_records() {
    let r = run_host(
        "host-qemu-11",
        VmConfig {
            qemu: QemuBuild::V11,
            host_args: vec!["--irq".into(), "--pop".into(), "--submit".into()],
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    assert!(r.qemu_version.starts_with("11."), "{}", r.qemu_version);
    let line = attach_line(&r);
    assert!(line.contains("(via process root)"), "{line}");
    assert!(
        line.contains(&format!("/proc/{}/root/", r.qemu_pid)),
        "{line}"
    );
    assert!(line.contains("QEMU 11."), "{line}");
    assert!(line.contains("NOT known for this version"), "{line}");
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert!(!log.contains("REFUSED"), "{log}");
    // A CET build (every function starts with endbr64): the uprobes go past it, where the
    // kernel emulates the probed push instead of single-stepping, and virtqueue_pop's
    // (--pop: a uprobe and a uretprobe) on its first jne; blk_aio_preadv reloads its
    // QEMUIOVector's register before any emulated instruction: past endbr64 only, and
    // single-stepped (the records below are still exact).
    assert_sites(
        &log,
        &[
            "virtqueue_push +0x4 (push)",
            "virtio_notify +0x4 (push)",
            "virtqueue_pop +0xf (jne)",
            "blk_aio_preadv +0x4 (sub)",
        ],
    );
    assert!(
        log.lines()
            .any(|l| l.contains("uprobes single-stepped") && l.contains("blk_aio_preadv (sub)")),
        "{log}"
    );
    // 10.2+ has no virtio_notify_irqfd; served by the main loop, it raises the interrupt
    // in virtio_notify. With --irq that is trapped: every guest notification is a
    // virtio_notify on the traced queue, a second trap per request (counted as the
    // request's own), and every record has h.irq.
    let v = host::final_stats(&r.out_dir).values;
    assert!(v["guest_notifications"] >= 650, "{v:?}");
    assert_eq!(v["virtio_notify_traced"], v["guest_notifications"], "{v:?}");
    assert_eq!(v["irq_untraced"], 0, "{v:?}");
    check_known_io(&r, Backend::Threads);
    // The device label comes through VirtIOBlock.blk → BlockBackend.name.
    let all = elems(&r);
    for v in known_io_device(&all) {
        assert_eq!(v.device, "vextra", "{v:?}");
    }
}

/// One host agent, two VMs side by side; VM a's layout is corrupted through the
/// test hook. A is refused (naming the field) and none of its records is written;
/// B is traced throughout: exactly its 400 fio requests.
#[test]
fn refused_vm_does_not_stop_the_other() {
    let _g = lab_lock();
    let dir = out_dir("host-refuse-two");
    std::fs::create_dir_all(&dir).unwrap();
    let args: Vec<String> = ["--vm", "vt-rf-a", "--vm", "vt-rf-b"]
        .map(String::from)
        .into();
    let override_a = [("VIOTRACE_HOST_LAYOUT_OVERRIDE", "vt-rf-a:req_out=0x90")];
    let mut host = host::start(&dir, &args, &override_a);
    let vm = |name: &str, offset: u32| {
        let cfg = VmConfig {
            name: format!("vt-rf-{name}"),
            agents: Agents::None,
            extra_disk_mib: Some(64),
            ..VmConfig::default()
        };
        // The agent discovers VMs once a second: wait before the I/O.
        let wl = format!(
            "sleep 3\nfio --name=x --filename=/dev/vdb --rw=randrw --bs=4k --direct=1 \
             --ioengine=psync --offset={offset}M --size=8M --number_ios=400 --output=/dev/null\n\
             sleep 1\n"
        );
        let out = dir.join(name);
        std::thread::spawn(move || lab().run(&cfg, &wl, &out))
    };
    let a = vm("a", 0);
    let b = vm("b", 32);
    let ra = a.join().unwrap().expect("VM a");
    let rb = b.join().unwrap().expect("VM b");
    let (st, _) = host::stop(&mut host);
    let log = std::fs::read_to_string(dir.join("host.log")).unwrap();
    assert!(st.success(), "host agent: {st}\n{log}");
    assert_eq!((ra.workload_rc, rb.workload_rc), (0, 0));
    let refused: Vec<&str> = log.lines().filter(|l| l.contains("REFUSED")).collect();
    assert_eq!(refused.len(), 1, "{log}");
    assert!(
        refused[0].contains(&format!("pid {}:", ra.qemu_pid))
            && refused[0].contains("VirtIOBlockReq.out looks wrong"),
        "{log}"
    );
    let host = Records::read(&dir.join("host.jsonl")).unwrap();
    let recs = host.host_elems();
    let of = |pid: u32| recs.iter().filter(move |v| v.qemu_pid == pid);
    assert_eq!(of(ra.qemu_pid).count(), 0, "no record of the refused VM");
    let b_fio = of(rb.qemu_pid)
        .filter(|v| v.device == "vextra")
        .filter(|v| (32 * 2048..40 * 2048).contains(&v.sector))
        .count();
    assert_eq!(b_fio, 400, "VM b: all 400 fio requests traced\n{log}");
}
