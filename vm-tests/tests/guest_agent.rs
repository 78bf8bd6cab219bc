//! End-to-end tests of the guest agent (issue 3) in real guests.

use serde_json::Value;
use viotrace_shared::record::Point;
use viotrace_vm_tests::{Agents, RunResult, VmConfig};

mod common;
use common::{known_io_shape, run_agents, Shape, KNOWN_IO};

fn run_guest(name: &str, cfg: VmConfig, workload: &str) -> RunResult {
    let r = run_agents(name, Agents::Guest, cfg, workload);
    assert_eq!(r.guest_agent_rc, Some(0), "guest agent exit status");
    r
}

fn kind<'a>(recs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    recs.iter().filter(|v| v["kind"] == kind).collect()
}

fn guest_log(r: &RunResult) -> String {
    std::fs::read_to_string(r.path("guest.log")).unwrap_or_default()
}

/// Points present in a record, in path order, must carry non-decreasing times.
fn assert_points_in_order(rec: &Value) {
    let ts = rec["ts"].as_object().expect("ts object");
    let mut seen: Vec<(Point, u64)> = ts
        .iter()
        .map(|(k, v)| {
            let p = Point::from_name(k).unwrap_or_else(|| panic!("unknown point {k} in {rec}"));
            let t = v.as_u64().expect("ns");
            assert!(t > 0, "zero timestamp for {k}: {rec}");
            (p, t)
        })
        .collect();
    seen.sort();
    for w in seen.windows(2) {
        // Buffered I/O: the syscall can return before its write-back request is issued.
        if w[1].0 == Point::SyscallExit {
            continue;
        }
        assert!(
            w[0].1 <= w[1].1,
            "{} ({}) after {} ({}) in {rec}",
            w[0].0,
            w[0].1,
            w[1].0,
            w[1].1
        );
    }
}

/// Checks the KNOWN_IO records on vdb; returns them.
fn check_known_io(r: &RunResult, with_virtio: bool) -> Vec<Value> {
    let recs = r.jsonl("guest.jsonl").expect("guest.jsonl");
    let rqs: Vec<Value> = kind(&recs, "guest_rq")
        .into_iter()
        .filter(|v| v["disk"] == "vdb")
        .cloned()
        .collect();
    let mut by_shape = Shape::new();
    for v in &rqs {
        *by_shape
            .entry((
                v["op"].as_str().unwrap_or("?").to_string(),
                v["bytes"].as_u64().unwrap_or(0),
            ))
            .or_default() += 1;
    }
    assert_eq!(
        by_shape,
        known_io_shape(),
        "vdb requests by (op, bytes); log:\n{}",
        guest_log(r)
    );
    let mut dd_sectors: Vec<u64> = Vec::new();
    for v in &rqs {
        let sector = v["sector"].as_u64().expect("sector");
        let bytes = v["bytes"].as_u64().unwrap();
        assert!(
            v["pid"].as_u64().unwrap() > 0 && v["tid"].as_u64().unwrap() > 0,
            "{v}"
        );
        let comm = v["comm"].as_str().unwrap();
        if bytes == 4096 {
            assert_eq!(comm, "fio", "{v}");
            assert!(sector % 8 == 0 && sector * 512 < 32 << 20, "{v}");
        } else {
            assert_eq!(comm, "dd", "{v}");
            dd_sectors.push(sector);
        }
        if with_virtio {
            let head = v["head"]
                .as_u64()
                .unwrap_or_else(|| panic!("head missing: {v}"));
            assert!(head < 256, "head {head} outside the 256-entry queue: {v}");
            assert_eq!(v["queue"].as_u64(), Some(0), "{v}");
            for p in ["g.rq_issue", "g.vq_add", "g.kick", "g.irq", "g.rq_complete"] {
                assert!(v["ts"][p].is_u64(), "{p} missing in {v}");
            }
        }
        assert!(
            v["ts"]["g.rq_issue"].is_u64() && v["ts"]["g.rq_complete"].is_u64(),
            "{v}"
        );
        assert_points_in_order(v);
    }
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
    let r = run_guest(
        "guest-fentry",
        VmConfig {
            guest_args: "--mode fentry".into(),
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    let rqs = check_known_io(&r, true);
    // Syscall-level records: each direct I/O syscall caused exactly one vdb request.
    let recs = r.jsonl("guest.jsonl").unwrap();
    let ios: Vec<&Value> = kind(&recs, "guest_io")
        .into_iter()
        .filter(|v| {
            v["requests"]
                .as_array()
                .is_some_and(|a| a.iter().any(|q| q["disk"] == "vdb"))
        })
        .collect();
    assert_eq!(
        ios.len(),
        rqs.len(),
        "guest_io records that caused vdb requests"
    );
    for io in ios {
        assert_eq!(io["requests"].as_array().unwrap().len(), 1, "{io}");
        assert!(io["ts"]["g.syscall_enter"].is_u64() && io["ts"]["g.syscall_exit"].is_u64());
    }
    // The agent is honest about what it sees.
    assert!(
        guest_log(&r).to_lowercase().contains("fentry"),
        "{}",
        guest_log(&r)
    );
}

#[test]
fn kprobe_mode_sees_every_request_down_to_the_virtqueue() {
    let r = run_guest(
        "guest-kprobe",
        VmConfig {
            guest_args: "--mode kprobe".into(),
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    check_known_io(&r, true);
}

#[test]
fn tracepoint_mode_degrades_to_block_layer_points() {
    let r = run_guest(
        "guest-tracepoint",
        VmConfig {
            guest_args: "--mode tracepoint".into(),
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    let rqs = check_known_io(&r, false);
    for v in &rqs {
        assert!(
            v["ts"].get("g.vq_add").is_none(),
            "tracepoint mode cannot see vq_add: {v}"
        );
        assert!(v["ts"].get("g.kick").is_none(), "{v}");
    }
    let log = guest_log(&r);
    assert!(
        log.contains("tracepoint"),
        "the agent says which mode it runs in: {log}"
    );
}

#[test]
fn two_queues_use_the_batched_submit_path() {
    let wl = "set -e\n\
        fio --name=q --filename=/dev/vdb --rw=randread --bs=4k --direct=1 --ioengine=libaio \
        --iodepth=8 --numjobs=2 --size=32M --number_ios=200 --randrepeat=0 --output=/dev/null\n";
    let r = run_guest(
        "guest-2q",
        VmConfig {
            smp: 2,
            queues: 2,
            ..VmConfig::default()
        },
        wl,
    );
    let recs = r.jsonl("guest.jsonl").unwrap();
    let rqs: Vec<&Value> = kind(&recs, "guest_rq")
        .into_iter()
        .filter(|v| v["disk"] == "vdb")
        .collect();
    assert_eq!(rqs.len(), 400, "2 jobs x 200 reads");
    let mut queues = std::collections::BTreeSet::new();
    for v in &rqs {
        assert_eq!(v["op"], "read");
        assert_eq!(v["bytes"], 4096);
        let head = v["head"].as_u64().expect("head");
        assert!(head < 256);
        queues.insert(v["queue"].as_u64().expect("queue"));
        assert_points_in_order(v);
    }
    assert_eq!(
        queues.into_iter().collect::<Vec<_>>(),
        vec![0, 1],
        "both virtqueues used"
    );
}

#[test]
fn filters_keep_exactly_the_selected_pid_comm_cgroup_and_disk() {
    // comm: fio and dd both run; only dd is kept.
    let r = run_guest(
        "guest-filter-comm",
        VmConfig {
            guest_args: "-c dd".into(),
            ..VmConfig::default()
        },
        KNOWN_IO,
    );
    let recs = r.jsonl("guest.jsonl").unwrap();
    let rqs = kind(&recs, "guest_rq");
    assert_eq!(rqs.len(), 50, "only dd's 50 reads");
    assert!(rqs.iter().all(|v| v["comm"] == "dd"));

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
    let recs = r.jsonl("guest.jsonl").unwrap();
    let rqs = kind(&recs, "guest_rq");
    assert_eq!(rqs.len(), 30, "only vdb's 30 reads");
    assert!(rqs.iter().all(|v| v["disk"] == "vdb"));

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
        let recs = r.jsonl("guest.jsonl").unwrap();
        let mut sectors: Vec<u64> = kind(&recs, "guest_rq")
            .iter()
            .map(|v| v["sector"].as_u64().unwrap())
            .collect();
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
    let recs = r.jsonl("guest.jsonl").unwrap();
    let bytes: u64 = kind(&recs, "guest_rq")
        .iter()
        .filter(|v| v["disk"] == "vda" && v["op"] == "write" && v["inode"] == inode)
        .map(|v| v["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(
        bytes,
        64 * 4096,
        "write-back bytes attributed to inode {inode}"
    );
}
