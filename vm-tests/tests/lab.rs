//! End-to-end tests of the lab itself (issue 2): real guests under QEMU.

use std::process::Command;
use std::time::Duration;

use viotrace_vm_tests::{Agents, Lab, VmConfig};

mod common;
use common::{lab, lab_lock, out_dir, qemu_processes_named};

/// 1000 random 4 KiB O_DIRECT writes with crc32c checksums, read back and verified in the guest.
fn verify_workload() -> String {
    "set -e\n\
     echo \"cpus possible=$(cat /sys/devices/system/cpu/possible) online=$(cat /sys/devices/system/cpu/online)\"\n\
     fio --name=verify --filename=/data/verify.dat --size=64M --rw=randwrite --bs=4k --direct=1 \
     --ioengine=psync --number_ios=1000 --norandommap=0 --randrepeat=0 --verify=crc32c \
     --do_verify=1 --verify_fatal=1 --output-format=json --output=/tmp/fio.json\n\
     cat /tmp/fio.json\n"
        .to_string()
}

fn check_verify_run(cfg: &VmConfig, name: &str) {
    let _g = lab_lock();
    let lab = lab();
    let out = out_dir(name);
    let r = lab.run(cfg, &verify_workload(), &out).expect("lab run");
    let log = r.workload_log();
    assert_eq!(r.workload_rc, 0, "workload failed:\n{log}");
    let json_start = log.find('{').expect("fio JSON in workload log");
    let v: serde_json::Value = serde_json::from_str(&log[json_start..]).expect("fio JSON");
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{job}");
    assert_eq!(job["write"]["total_ios"], 1000, "writes: {}", job["write"]);
    // Verification reads every written block back and checks its crc32c.
    assert_eq!(
        job["read"]["total_ios"], 1000,
        "verify reads: {}",
        job["read"]
    );
    assert!(
        r.boot_secs > 0.0 && r.boot_secs < 120.0,
        "boot {}",
        r.boot_secs
    );
    let summary = std::fs::read_to_string(r.path("summary.txt")).unwrap();
    assert!(summary.contains("boot to workload"), "{summary}");
    assert!(r.path("serial.log").exists());
    // Under TCG one vCPU gets a second, absent slot so that QEMU keeps the guest's locked
    // instructions as host barriers (config::smp_arg); the guest still runs on one CPU.
    let online = if cfg.smp == 1 { "0" } else { "0-1" };
    let possible = if summary.contains("accel=tcg") {
        "0-1"
    } else {
        online
    };
    let want = format!("cpus possible={possible} online={online}");
    assert!(log.contains(&want), "want `{want}` in:\n{log}");
}

#[test]
fn random_direct_writes_verify_one_queue() {
    let cfg = VmConfig {
        name: "vt-verify-1q".into(),
        ..VmConfig::default()
    };
    check_verify_run(&cfg, "verify-1q");
}

/// A guest that never boots (QEMU started with `-S`: its CPUs never run) is a boot hang:
/// the run stops at `boot_timeout`, not the run's timeout, boots it again once, and then
/// fails saying so, the first boot's console kept.
#[test]
fn a_guest_that_never_boots_is_booted_again_once_then_reported() {
    let _g = lab_lock();
    let out = out_dir("boot-hang");
    let cfg = VmConfig {
        name: "vt-boot-hang".into(),
        qemu_args: vec!["-S".into()],
        boot_timeout: Duration::from_secs(15),
        ..VmConfig::default()
    };
    let t = std::time::Instant::now();
    let e = lab()
        .run(&cfg, "echo never\n", &out)
        .expect_err("a guest that never runs never boots");
    let msg = format!("{e:#}");
    assert!(msg.contains("did not boot within 15s"), "{msg}");
    assert!(out.join("serial.boot-hang.log").exists());
    let first = std::fs::read_to_string(out.join("boot-hang.txt")).expect("boot-hang.txt");
    assert!(first.contains("did not boot within 15s"), "{first}");
    // Two boots of 15 s each, and the runs around them: far from the 10-minute timeout.
    assert!(t.elapsed() < Duration::from_secs(150), "{:?}", t.elapsed());
}

#[test]
fn random_direct_writes_verify_two_vcpus_two_queues() {
    let cfg = VmConfig {
        name: "vt-verify-2q".into(),
        smp: 2,
        queues: 2,
        ..VmConfig::default()
    };
    check_verify_run(&cfg, "verify-2q");
    // The guest really saw two queues.
    let _g = lab_lock();
    let out = out_dir("queues-2q");
    let r = lab()
        .run(
            &VmConfig {
                name: "vt-queues-2q".into(),
                smp: 2,
                queues: 2,
                ..VmConfig::default()
            },
            "ls /sys/block/$VIOTRACE_DISK/mq\n",
            &out,
        )
        .expect("lab run");
    let log = r.workload_log();
    let mut queues: Vec<&str> = log.split_whitespace().collect();
    queues.sort();
    assert_eq!(queues, ["0", "1"], "blk-mq hardware queues: {log}");
}

#[test]
fn hanging_workload_is_stopped_at_timeout_without_leftovers() {
    let _g = lab_lock();
    let name = format!("vt-hang-{}", std::process::id());
    let cfg = VmConfig {
        name: name.clone(),
        timeout: Duration::from_secs(25),
        ..VmConfig::default()
    };
    let out = out_dir("hang");
    // Timed from when this test holds the machine-wide VM lock: waiting for
    // another program's VM is not the lab's stop time.
    let _vm = viotrace_vm_tests::vmlock::default_lock_path()
        .map(|p| viotrace_vm_tests::vmlock::acquire(&p).expect("VM lock"));
    let t = std::time::Instant::now();
    let err = lab()
        .run(&cfg, "echo about-to-hang\nsleep 100000\n", &out)
        .expect_err("a hanging workload must fail");
    let msg = format!("{err:#}");
    assert!(msg.contains("timed out"), "{msg}");
    assert!(
        msg.contains("about-to-hang"),
        "error shows the serial tail: {msg}"
    );
    // QEMU's view of the data disk's queue when the run was stopped.
    assert!(
        msg.contains("QEMU's virtio-blk queues then") && msg.contains("queue 0: last_avail_idx="),
        "{msg}"
    );
    assert!(out.join("virtio-state.json").exists());
    // The hang dump (10 s before the deadline here): the disks' requests in
    // flight, and the hanging task with its state and kernel stack.
    let serial = std::fs::read_to_string(out.join("serial.log")).expect("serial.log");
    assert!(serial.contains("VIOTRACE-HANG-DUMP"), "{serial}");
    assert!(
        serial
            .lines()
            .any(|l| l.starts_with("disk vd") && l.contains("in flight")),
        "{serial}"
    );
    assert!(serial.contains("kernel log, last 40 lines:"), "{serial}");
    let task = serial
        .lines()
        .position(|l| l.starts_with("task ") && l.trim_end().ends_with("sleep 100000"))
        .unwrap_or_else(|| panic!("no line for the hanging task: {serial}"));
    let next: Vec<&str> = serial.lines().skip(task).take(4).collect();
    assert!(next[0].contains("[S (sleeping)]"), "{next:?}");
    assert!(
        next[1..].iter().any(|l| l.contains("nanosleep")),
        "its kernel stack: {next:?}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(90),
        "took {:?}",
        t.elapsed()
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        qemu_processes_named(&name),
        Vec::<u32>::new(),
        "QEMU left over"
    );
    assert_eq!(
        qemu_processes_named(&format!("viotrace-lab-{name}-")),
        Vec::<u32>::new(),
        "vsock backend or other helper left over"
    );
}

#[test]
fn cli_runs_any_user_script_and_reuses_the_cache() {
    let _g = lab_lock();
    // Warm the cache, so the CLI run below must not download anything.
    let _ = lab();
    let dir = out_dir("cli");
    let w = dir.join("w.sh");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        &w,
        "echo hello from $(uname -r) on $VIOTRACE_DISK\ngrep -q ' /data ext4 ' /proc/mounts && echo data-mounted\nexit 3\n",
    )
    .unwrap();
    // --post: after the workload, outside its window, even when it failed.
    let post = dir.join("post.sh");
    std::fs::write(&post, "echo post after $(cat /tmp/workload.rc)\nexit 5\n").unwrap();
    let out = dir.join("d");
    let o = Command::new(env!("CARGO_BIN_EXE_viotrace-vm"))
        .args(["run", "--quiet", "--agents", "none", "--workload"])
        .arg(&w)
        .arg("--post")
        .arg(&post)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(3), "stdout:{stdout}\nstderr:{stderr}");
    assert!(
        !stderr.contains("downloading"),
        "cache not reused: {stderr}"
    );
    let log = std::fs::read_to_string(out.join("workload.log")).unwrap();
    assert!(log.contains("hello from 6.1.0-"), "{log}");
    assert!(log.contains("on vda"), "{log}");
    assert!(log.contains("data-mounted"), "{log}");
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap();
    assert!(summary.contains("workload exit status: 3"), "{summary}");
    assert!(stdout.contains("boot to workload"), "{stdout}");
    assert!(out.join("serial.log").exists());
    let post_log = std::fs::read_to_string(out.join("post.log")).unwrap();
    assert_eq!(post_log.trim(), "post after 3");
    let post_rc = std::fs::read_to_string(out.join("post.rc")).unwrap();
    assert_eq!(post_rc.trim(), "5");
}

#[test]
fn agents_none_leaves_no_agent_outputs() {
    let _g = lab_lock();
    let out = out_dir("none");
    let r = lab()
        .run(
            &VmConfig {
                name: "vt-none".into(),
                agents: Agents::None,
                ..VmConfig::default()
            },
            "true\n",
            &out,
        )
        .unwrap();
    assert_eq!(r.workload_rc, 0);
    assert!(!r.path("guest.jsonl").exists());
    assert!(!r.path("host.jsonl").exists());
    assert!(r.records("nonexistent.jsonl").is_err());
    let _: &Lab = lab();
}

#[test]
fn a_second_lab_waits_for_the_vm_lock() {
    let _g = lab_lock();
    let dir = out_dir("vm-lock");
    std::fs::create_dir_all(&dir).unwrap();
    let lock_path = dir.join("vm.lock");
    let mut own = Lab::new().expect("lab");
    own.set_vm_lock(Some(lock_path.clone()));
    // Another program holds the lock.
    let mut other = viotrace_vm_tests::vmlock::hold_in_other_process(&lock_path).unwrap();
    let out = dir.join("run");
    let t0 = std::time::Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let out2 = out.clone();
    let runner = std::thread::spawn(move || {
        let cfg = VmConfig {
            name: "vt-vm-lock".into(),
            ..VmConfig::default()
        };
        let r = own.run(&cfg, "true\n", &out2);
        tx.send(std::time::Instant::now()).unwrap();
        r.map(|r| r.workload_rc)
    });
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        rx.try_recv().is_err() && !out.join("serial.log").exists(),
        "the VM started while another lab held the lock"
    );
    let released = std::time::Instant::now();
    drop(other.stdin.take());
    assert!(other.wait().unwrap().success());
    let finished = rx.recv_timeout(Duration::from_secs(120)).expect("run ends");
    assert_eq!(runner.join().unwrap().expect("lab run"), 0);
    assert!(finished > released && t0.elapsed() > Duration::from_secs(4));
}
