//! Helpers shared by the lab's end-to-end tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use viotrace_shared::record::Point;
use viotrace_vm_tests::{assets, Agents, Lab, RunResult, VmConfig};

/// The guest points `--skip-points lean` leaves out.
pub const LEAN_POINTS: [Point; 4] = [
    Point::Kick,
    Point::Irq,
    Point::DriverComplete,
    Point::BioComplete,
];

pub mod checks;
pub mod guest;
pub mod host;
pub mod host_run;
pub mod http;

/// The lab, prepared once per test binary.
pub fn lab() -> &'static Lab {
    static LAB: OnceLock<Lab> = OnceLock::new();
    LAB.get_or_init(|| Lab::new().expect("prepare the lab (run scripts/setup.sh first)"))
}

/// VMs use a whole core each: tests in one binary run them one at a time.
pub fn lab_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A fresh output directory for a test, under target/lab-tests/.
pub fn out_dir(name: &str) -> PathBuf {
    let d = assets::workspace_root()
        .join("target")
        .join("lab-tests")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Pids of processes (other than this one) whose command line contains `needle`.
pub fn qemu_processes_named(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(needle) {
            pids.push(pid);
        }
    }
    pids
}

/// Exactly known I/O on the blank raw disk vdb: 300 random 4 KiB O_DIRECT writes, 300 random
/// 4 KiB reads (fio, psync), and 50 sequential 64 KiB reads (dd).
pub const KNOWN_IO: &str = "set -e\n\
fio --name=w --filename=/dev/vdb --rw=randwrite --bs=4k --direct=1 --ioengine=psync --size=32M \
--number_ios=300 --randrepeat=0 --output=/dev/null\n\
fio --name=r --filename=/dev/vdb --rw=randread --bs=4k --direct=1 --ioengine=psync --size=32M \
--number_ios=300 --randrepeat=0 --output=/dev/null\n\
dd if=/dev/vdb of=/dev/null bs=64k count=50 iflag=direct\n";

/// (op, bytes) → count.
pub type Shape = std::collections::BTreeMap<(String, u64), usize>;

/// KNOWN_IO's requests by (op, bytes).
pub fn known_io_shape() -> Shape {
    [
        (("write".to_string(), 4096), 300),
        (("read".to_string(), 4096), 300),
        (("read".to_string(), 65536), 50),
    ]
    .into_iter()
    .collect()
}

/// Runs `workload` in a VM named `vt-<name>` with `agents` and a 64 MiB blank vdb.
pub fn run_agents(name: &str, agents: Agents, cfg: VmConfig, workload: &str) -> RunResult {
    let _g = lab_lock();
    let cfg = VmConfig {
        name: format!("vt-{name}"),
        agents,
        extra_disk_mib: Some(64),
        ..cfg
    };
    let r = lab().run(&cfg, workload, &out_dir(name)).expect("lab run");
    assert_eq!(r.workload_rc, 0, "workload failed:\n{}", r.workload_log());
    r
}
