//! End-to-end tests of the host agent (issue 4): stock QEMU traced from the host.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use viotrace_vm_tests::{Agents, Aio, DiskFormat, HostAttach, RunResult, VmConfig};

mod common;
use common::{known_io_shape, run_agents, Shape, KNOWN_IO};

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

/// Host records of the workload window (the host also sees the guest's boot-time I/O,
/// such as the partition scan of each disk).
fn elems(r: &RunResult) -> Vec<Value> {
    assert!(r.workload_start_ns > 0 && r.workload_end_ns >= r.workload_start_ns);
    r.jsonl("host.jsonl")
        .expect("host.jsonl")
        .into_iter()
        .filter(|v| v["kind"] == "host_elem")
        .filter(|v| {
            let first = v["ts"]
                .as_object()
                .and_then(|m| m.values().filter_map(|t| t.as_u64()).min())
                .unwrap_or(0);
            first >= r.workload_start_ns
        })
        .collect()
}

fn shape(recs: &[&Value]) -> Shape {
    let mut m = BTreeMap::new();
    for v in recs {
        *m.entry((
            v["op"].as_str().unwrap_or("?").to_string(),
            v["bytes"].as_u64().unwrap_or(0),
        ))
        .or_default() += 1;
    }
    m
}

/// The vdb device's records: the device whose records carry the known workload.
fn known_io_device(all: &[Value]) -> Vec<&Value> {
    let mut by_dev: BTreeMap<String, Vec<&Value>> = BTreeMap::new();
    for v in all {
        by_dev
            .entry(v["device"].as_str().unwrap_or("?").to_string())
            .or_default()
            .push(v);
    }
    let expect = known_io_shape();
    let shapes: Vec<(String, Shape)> = by_dev.iter().map(|(d, v)| (d.clone(), shape(v))).collect();
    let Some((dev, _)) = shapes.iter().find(|(_, s)| *s == expect) else {
        panic!(
            "no device carries exactly the known I/O; per device (op, bytes) counts: {shapes:?}"
        );
    };
    by_dev.remove(dev).unwrap()
}

fn check_known_io(r: &RunResult, backend: &str) {
    let all = elems(r);
    let recs = known_io_device(&all);
    let mut dd = Vec::new();
    for v in &recs {
        assert_eq!(v["backend"], backend, "{v}");
        assert_eq!(v["queue"], 0, "{v}");
        assert!(v["head"].as_u64().expect("head") < 256, "{v}");
        assert!(v["qemu_pid"].as_u64() == Some(u64::from(r.qemu_pid)), "{v}");
        let sector = v["sector"].as_u64().unwrap();
        if v["bytes"] == 65536 {
            dd.push(sector);
        } else {
            assert!(sector % 8 == 0 && sector * 512 < 32 << 20, "{v}");
        }
        // h.pop needs the optional virtqueue_pop uprobe (--pop); h.notify is the kick handling.
        let pop = v["ts"]["h.pop"]
            .as_u64()
            .or(v["ts"]["h.notify"].as_u64())
            .unwrap_or_else(|| panic!("h.pop or h.notify: {v}"));
        let push = v["ts"]["h.push"]
            .as_u64()
            .unwrap_or_else(|| panic!("h.push: {v}"));
        assert!(pop > 0 && pop <= push, "{v}");
        for (k, t) in v["ts"].as_object().unwrap() {
            assert!(k.starts_with("h.") && t.as_u64().unwrap() > 0, "{v}");
        }
    }
    dd.sort();
    assert_eq!(dd, (0..50).map(|i| i * 128).collect::<Vec<u64>>());
}

#[test]
fn threads_backend_one_record_per_element() {
    let r = run_host("host-threads", VmConfig::default(), KNOWN_IO);
    check_known_io(&r, "threads");
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
    check_known_io(&r, "native");
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
    check_known_io(&r, "io_uring");
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
    check_known_io(&r, "threads");
}

#[test]
fn merged_sequential_writes_share_a_merge_id() {
    // The guest must not merge them itself, so QEMU's multireq merge does.
    let wl = "set -e\n\
        echo 2 >/sys/block/vdb/queue/nomerges\n\
        fio --name=seq --filename=/dev/vdb --rw=write --bs=4k --direct=1 --ioengine=libaio \
        --iodepth=16 --iodepth_batch_submit=16 --size=4M --output=/dev/null\n";
    let r = run_host("host-merge", VmConfig::default(), wl);
    let all = elems(&r);
    let writes: Vec<&Value> = all
        .iter()
        .filter(|v| v["op"] == "write" && v["bytes"] == 4096)
        .collect();
    assert!(
        writes.len() >= 1024,
        "4 MiB in 4 KiB writes: {}",
        writes.len()
    );
    let mut groups: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for v in &writes {
        groups
            .entry(v["merge_id"].as_u64().expect("merge_id"))
            .or_default()
            .push(v["sector"].as_u64().unwrap());
    }
    let merged: Vec<&Vec<u64>> = groups.values().filter(|g| g.len() > 1).collect();
    assert!(
        !merged.is_empty(),
        "no merged backend I/O among {} groups",
        groups.len()
    );
    for g in merged {
        let mut s = g.clone();
        s.sort();
        for w in s.windows(2) {
            assert_eq!(w[1], w[0] + 8, "merged elements are contiguous: {s:?}");
        }
    }
}

#[test]
fn agent_started_before_qemu_discovers_it() {
    let wl = format!("sleep 3\n{KNOWN_IO}");
    let r = run_host(
        "host-before",
        VmConfig {
            host_attach: HostAttach::BeforeQemu,
            // Discovery follows only this VM (other QEMUs may run on the machine).
            host_args: vec!["--vm".into(), "vt-host-before".into()],
            ..VmConfig::default()
        },
        &wl,
    );
    check_known_io(&r, "threads");
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
        .filter(|v| v["op"] == "read" && v["bytes"] == 4096)
        .filter_map(|v| v["sector"].as_u64())
        .filter(|s| (80_000..80_800).contains(s))
        .collect();
    assert_eq!(
        reads.len(),
        100,
        "dd's reads (beyond fio's 32 MiB) after the attach are all seen"
    );
}
