//! End-to-end tests of the joined mode (issue 5): both agents, one record per I/O.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use viotrace_vm_tests::{assets, read_jsonl, Agents, RunResult, VmConfig};

mod common;
use common::{lab, lab_lock, out_dir, run_agents};

/// Random and sequential reads and writes on vdb (raw) and buffered writes + fsync on /data.
const MIXED: &str = "set -e\n\
fio --name=rr --filename=/dev/vdb --rw=randread --bs=4k --direct=1 --ioengine=psync --size=32M \
--number_ios=300 --output=/dev/null\n\
fio --name=rw --filename=/dev/vdb --rw=randwrite --bs=4k --direct=1 --ioengine=libaio --iodepth=8 \
--size=32M --number_ios=300 --output=/dev/null\n\
fio --name=sr --filename=/dev/vdb --rw=read --bs=128k --direct=1 --ioengine=psync --offset=32M \
--size=8M --output=/dev/null\n\
fio --name=sw --filename=/dev/vdb --rw=write --bs=64k --direct=1 --ioengine=libaio --iodepth=4 \
--offset=40M --size=8M --output=/dev/null\n\
dd if=/dev/urandom of=/data/buffered.dat bs=4k count=100 conv=fsync 2>/dev/null\n\
sleep 1\n";

fn rec_key(v: &Value) -> (String, String, u64, u64) {
    (
        v["disk"].as_str().unwrap_or("?").to_string(),
        v["op"].as_str().unwrap_or("?").to_string(),
        v["sector"].as_u64().unwrap_or(u64::MAX),
        v["bytes"].as_u64().unwrap_or(0),
    )
}

/// Checks the joined records against the guest's own: coverage, stages, consistency.
fn check_joined(guest: &[Value], joined: &[Value], min_ratio: f64) {
    let guest_rqs: Vec<&Value> = guest.iter().filter(|v| v["kind"] == "guest_rq").collect();
    assert!(
        guest_rqs.len() > 500,
        "too few guest requests: {}",
        guest_rqs.len()
    );
    let mut joined_keys: HashMap<(String, String, u64, u64), usize> = HashMap::new();
    let mut n_joined = 0;
    for j in joined {
        assert_eq!(j["kind"], "io", "{j}");
        if j["joined"] != true {
            assert!(j["reason"].is_string(), "unmatched without a reason: {j}");
            continue;
        }
        n_joined += 1;
        *joined_keys.entry(rec_key(j)).or_default() += 1;
        // Both sides are there, in one clock domain.
        assert_eq!(j["ts_domain"], "host", "{j}");
        let ts = j["ts"].as_object().unwrap();
        assert!(ts.keys().any(|k| k.starts_with("g.")) && ts.keys().any(|k| k.starts_with("h.")));
        let unc = j["clock_uncertainty_ns"].as_i64().expect("uncertainty");
        let stages = j["stages"].as_object().expect("stages");
        let mut sum = 0i64;
        for (name, ns) in stages {
            let ns = ns.as_i64().unwrap();
            assert!(ns >= -unc, "stage {name} = {ns} < -{unc}: {j}");
            sum += ns;
        }
        assert_eq!(
            Some(sum),
            j["total_ns"].as_i64(),
            "stages add up to total: {j}"
        );
        for s in [
            "guest_queue",
            "kick_to_pop",
            "host_io",
            "push_to_irq",
            "guest_complete",
        ] {
            // Flushes made by the flush machinery have no bio of their own.
            if s == "guest_queue" && !ts.contains_key("g.bio_queue") {
                continue;
            }
            assert!(
                stages
                    .keys()
                    .any(|k| k == s || k.split('+').any(|p| p == s)),
                "stage {s} missing: {j}"
            );
        }
    }
    // Every guest request (op, sector, bytes on its disk) has its joined record.
    let mut missing = 0usize;
    for g in &guest_rqs {
        match joined_keys.get_mut(&rec_key(g)) {
            Some(n) if *n > 0 => *n -= 1,
            _ => missing += 1,
        }
    }
    let ratio = 1.0 - missing as f64 / guest_rqs.len() as f64;
    assert!(
        ratio >= min_ratio,
        "only {:.4} of {} guest requests joined ({missing} missing, {n_joined} joined records)",
        ratio,
        guest_rqs.len()
    );
}

fn run_both(name: &str, cfg: VmConfig, workload: &str) -> RunResult {
    let r = run_agents(name, Agents::Both, cfg, workload);
    let hlog = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert_eq!(r.host_agent_rc, Some(0), "host agent:\n{hlog}");
    assert_eq!(r.guest_agent_rc, Some(0), "guest agent");
    r
}

#[test]
fn mixed_workload_one_queue_is_joined() {
    let trace = assets::workspace_root().join("target/lab-tests/joined-1q-trace.json");
    let _ = std::fs::remove_file(&trace);
    let r = run_both(
        "joined-1q",
        VmConfig {
            host_args: vec!["--chrome-trace".into(), trace.display().to_string()],
            ..VmConfig::default()
        },
        MIXED,
    );
    let joined = r.jsonl("joined.jsonl").unwrap();
    check_joined(&r.jsonl("guest.jsonl").unwrap(), &joined, 0.999);

    // The Perfetto / chrome://tracing export: one process for the VM, a track per
    // disk queue, one complete slice per request with its stages nested inside.
    let t: Value = serde_json::from_slice(&std::fs::read(&trace).expect("trace written"))
        .expect("trace is JSON");
    let events = t["traceEvents"].as_array().expect("traceEvents");
    let names: BTreeSet<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .filter_map(|e| e["args"]["name"].as_str())
        .collect();
    assert!(
        names.contains("vt-joined-1q"),
        "process named after the VM: {names:?}"
    );
    assert!(
        names.iter().any(|n| n.starts_with("vdb q0")),
        "track per queue: {names:?}"
    );
    let slices: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    let n_joined = joined.iter().filter(|j| j["joined"] == true).count();
    let requests = slices.iter().filter(|e| e["cat"] == "io").count();
    assert!(
        requests >= n_joined,
        "{requests} request slices for {n_joined} joined I/Os"
    );
    assert!(
        slices
            .iter()
            .any(|e| e["cat"] == "stage" && e["name"] == "host_io"),
        "stages as slices"
    );
}

#[test]
fn mixed_workload_two_queues_is_joined() {
    let r = run_both(
        "joined-2q",
        VmConfig {
            smp: 2,
            queues: 2,
            ..VmConfig::default()
        },
        MIXED,
    );
    let joined = r.jsonl("joined.jsonl").unwrap();
    check_joined(&r.jsonl("guest.jsonl").unwrap(), &joined, 0.999);
    let queues: BTreeSet<u64> = joined
        .iter()
        .filter(|j| j["joined"] == true && j["disk"] == "vdb")
        .filter_map(|j| j["queue"].as_u64())
        .collect();
    assert_eq!(queues.into_iter().collect::<Vec<_>>(), vec![0, 1]);
}

fn sectors_in(recs: &[Value], lo: u64, hi: u64) -> usize {
    recs.iter()
        .filter(|j| j["joined"] == true && j["disk"] == "vdb" && j["bytes"] == 4096)
        .filter(|j| j["sector"].as_u64().is_some_and(|s| (lo..hi).contains(&s)))
        .count()
}

#[test]
fn restarting_either_agent_mid_run_recovers() {
    // Three phases on distinct ranges of vdb: before any restart, after the guest agent
    // restarted, after the host agent restarted.
    let phase = |off_mib: u32| {
        format!(
            "fio --name=p{off_mib} --filename=/dev/vdb --rw=randwrite --bs=4k --direct=1 \
             --ioengine=psync --offset={off_mib}M --size=8M --number_ios=200 --output=/dev/null\n"
        )
    };
    let wl = format!(
        "set -e\n{}\
         kill -INT $(pidof viotrace-guest)\n\
         while pidof viotrace-guest >/dev/null; do sleep 0.1; done\n\
         eval \"set -- $VIOTRACE_GUEST_ARGS\"\n\
         viotrace-guest --json --ready-file /run/g2.ready \"$@\" >/out/guest.2.jsonl 2>/out/guest.2.log &\n\
         G2=$!\n\
         while [ ! -e /run/g2.ready ]; do sleep 0.1; done\n\
         {}\
         echo VIOTRACE-HOST-AGENT-RESTART\n\
         sleep 12\n\
         {}\
         sleep 2\n\
         kill -INT $G2; wait $G2\n",
        phase(0),
        phase(8),
        phase(16)
    );
    let r = run_both("joined-restart", VmConfig::default(), &wl);
    let first = r.jsonl("joined.jsonl").unwrap();
    let second = r
        .jsonl("joined.1.jsonl")
        .expect("the restarted host agent's joined output");
    let mib = 2048u64; // sectors per MiB
    assert_eq!(sectors_in(&first, 0, 8 * mib), 200, "phase 1 joined");
    assert_eq!(
        sectors_in(&first, 8 * mib, 16 * mib),
        200,
        "phase 2 (new guest agent) joined"
    );
    assert_eq!(
        sectors_in(&second, 16 * mib, 24 * mib),
        200,
        "phase 3 (new host agent) joined"
    );
    // Losses are counted, not silent: every agent reports its counters.
    for f in ["host.jsonl", "host.1.jsonl"] {
        let stats = read_jsonl(&r.path(f)).unwrap();
        let last = stats
            .iter()
            .rev()
            .find(|v| v["kind"] == "stats")
            .expect("stats line");
        for k in [
            "joined",
            "unmatched_guest",
            "unmatched_host",
            "guest_transport_dropped",
        ] {
            assert!(last[k].is_u64(), "{f}: counter {k} missing in {last}");
        }
    }
    let g2 = std::fs::read_to_string(r.path("guest.2.log")).unwrap_or_default();
    assert!(
        g2.contains("uplink_connects="),
        "guest agent reports its uplink: {g2}"
    );
}

/// Sends hostile bytes to a host agent's guest socket.
fn hostile_guest(path: &Path) {
    let frames: Vec<Vec<u8>> = vec![
        // Garbage payload in a well-formed frame.
        {
            let mut f = 16u32.to_le_bytes().to_vec();
            f.extend_from_slice(&[0xff; 16]);
            f
        },
        // Oversized frame header (1 GiB).
        (1u32 << 30).to_le_bytes().to_vec(),
        // Truncated: promises 100 bytes, sends 10, hangs up.
        {
            let mut f = 100u32.to_le_bytes().to_vec();
            f.extend_from_slice(&[1; 10]);
            f
        },
    ];
    for f in frames {
        if let Ok(mut s) = UnixStream::connect(path) {
            let _ = s.write_all(&f);
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

#[test]
fn one_host_agent_two_vms_never_mix_and_survive_a_hostile_guest() {
    let _g = lab_lock();
    let dir = out_dir("joined-two");
    std::fs::create_dir_all(&dir).unwrap();
    let sock = |vm: &str| dir.join(format!("{vm}.sock"));
    let host_bin = assets::host_agent_binary().unwrap();
    let ready = dir.join("host.ready");
    let mut host = Command::new(&host_bin)
        .args([
            "--vm",
            "vt-two-a",
            "--vm",
            "vt-two-b",
            "--json",
            "--ready-file",
        ])
        .arg(&ready)
        .arg("--listen-uds")
        .arg(format!("vt-two-a={}_5515", sock("a").display()))
        .arg("--listen-uds")
        .arg(format!("vt-two-b={}_5515", sock("b").display()))
        .arg("--joined-out")
        .arg(dir.join("joined.jsonl"))
        .stdout(std::fs::File::create(dir.join("host.jsonl")).unwrap())
        .stderr(std::fs::File::create(dir.join("host.log")).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !ready.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "host agent not ready"
        );
        assert!(host.try_wait().unwrap().is_none(), "host agent died");
        std::thread::sleep(Duration::from_millis(50));
    }
    let vm = |name: &str, s: &str, offset: u32| {
        let cfg = VmConfig {
            name: format!("vt-two-{name}"),
            agents: Agents::Guest,
            extra_disk_mib: Some(64),
            vsock_uds: Some(sock(s)),
            guest_args: "--connect vsock:2:5515".into(),
            ..VmConfig::default()
        };
        // Wait for the host agent to discover the VM before doing I/O.
        let wl = format!(
            "sleep 3\nfio --name=x --filename=/dev/vdb --rw=randrw --bs=4k --direct=1 \
             --ioengine=psync --offset={offset}M --size=8M --number_ios=400 --output=/dev/null\nsleep 1\n"
        );
        let out = dir.join(name);
        std::thread::spawn(move || lab().run(&cfg, &wl, &out))
    };
    let a = vm("a", "a", 0);
    let b = vm("b", "b", 32);
    std::thread::sleep(Duration::from_secs(8));
    hostile_guest(&dir.join("a.sock_5515"));
    let ra = a.join().unwrap().expect("VM a");
    let rb = b.join().unwrap().expect("VM b");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(host.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let st = host.wait().unwrap();
    let log = std::fs::read_to_string(dir.join("host.log")).unwrap();
    assert!(st.success(), "host agent: {st}\n{log}");
    let joined = read_jsonl(&dir.join("joined.jsonl")).unwrap();
    let mut per_vm: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for j in joined {
        per_vm
            .entry(j["vm"].as_str().unwrap_or("?").to_string())
            .or_default()
            .push(j);
    }
    for (r, vmname, lo, hi) in [
        (&ra, "vt-two-a", 0u64, 8 * 2048u64),
        (&rb, "vt-two-b", 32 * 2048, 40 * 2048),
    ] {
        assert_eq!(r.workload_rc, 0);
        let mine = per_vm.remove(vmname).unwrap_or_default();
        let guest = r.jsonl("guest.jsonl").unwrap();
        let guest_vdb: Vec<Value> = guest
            .into_iter()
            .filter(|v| v["kind"] == "guest_rq" && v["disk"] == "vdb")
            .collect();
        assert_eq!(guest_vdb.len(), 400, "{vmname}: guest saw its 400 I/Os");
        let joined_vdb: Vec<&Value> = mine
            .iter()
            .filter(|j| j["joined"] == true && j["disk"] == "vdb")
            .collect();
        assert_eq!(joined_vdb.len(), 400, "{vmname}: all 400 joined");
        for j in joined_vdb {
            let s = j["sector"].as_u64().unwrap();
            assert!(
                (lo..hi).contains(&s),
                "{vmname} got a record of the other VM: {j}"
            );
            assert_eq!(j["qemu_pid"].as_u64(), Some(u64::from(r.qemu_pid)), "{j}");
        }
    }
    // The hostile connections were rejected with a reason, and counted.
    assert!(log.contains("with an error"), "rejections logged:\n{log}");
    let stats = read_jsonl(&dir.join("host.jsonl")).unwrap();
    let last = stats.iter().rev().find(|v| v["kind"] == "stats").unwrap();
    assert!(
        last["bad_guest_connections"].as_u64().unwrap() >= 3,
        "{last}"
    );
}
