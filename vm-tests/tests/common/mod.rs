//! Helpers shared by the lab's end-to-end tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use viotrace_vm_tests::{assets, Lab};

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
