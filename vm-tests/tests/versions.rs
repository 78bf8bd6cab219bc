//! The lab on other guest kernels and QEMU builds (issue 9): each boots, runs O_DIRECT I/O
//! on a second virtio-blk disk, and the guest runs the kernel the lab says it booted.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use viotrace_vm_tests::assets::{GuestKernel, QemuBuild};
use viotrace_vm_tests::{Agents, RunResult, VmConfig};

mod common;
use common::{lab, lab_lock, out_dir, qemu_processes_named};

/// 200 random 4 KiB O_DIRECT writes verified by reading back (fio, crc32c), then 20
/// sequential 64 KiB O_DIRECT reads (dd), all on the blank disk vdb.
const DIRECT_IO: &str = "set -e\n\
echo \"release=$(uname -r)\"\n\
test -e /sys/kernel/btf/vmlinux && echo btf=yes\n\
fio --name=v --filename=/dev/vdb --rw=randwrite --bs=4k --direct=1 --ioengine=psync --size=16M \
--number_ios=200 --randrepeat=0 --verify=crc32c --do_verify=1 --verify_fatal=1 \
--output-format=terse --terse-version=3 --output=/tmp/fio.terse\n\
cut -d';' -f3,5,6,47 /tmp/fio.terse | sed 's/^/fio=/'\n\
dd if=/dev/vdb of=/dev/null bs=64k count=20 iflag=direct 2>&1 | sed 's/^/dd: /'\n";

fn run_direct_io(name: &str, cfg: VmConfig) -> RunResult {
    let _g = lab_lock();
    let cfg = VmConfig {
        name: format!("vt-{name}"),
        agents: Agents::None,
        extra_disk_mib: Some(32),
        ..cfg
    };
    let r = lab()
        .run(&cfg, DIRECT_IO, &out_dir(name))
        .unwrap_or_else(|e| panic!("lab run {name}: {e:#}"));
    let log = r.workload_log();
    assert_eq!(r.workload_rc, 0, "workload failed:\n{log}");
    assert!(
        log.contains(&format!("release={}\n", r.kernel_release)),
        "guest runs {} according to the lab:\n{log}",
        r.kernel_release
    );
    assert!(
        log.contains("btf=yes"),
        "no /sys/kernel/btf/vmlinux:\n{log}"
    );
    // terse v3 fields 3, 5, 6, 47: jobname, error, read total I/O (KiB), write total I/O (KiB).
    let fio = log
        .lines()
        .find_map(|l| l.strip_prefix("fio="))
        .unwrap_or_else(|| panic!("no fio line:\n{log}"));
    let f: Vec<&str> = fio.split(';').collect();
    assert_eq!(f.len(), 4, "fio terse line: {fio}");
    assert_eq!(f[1], "0", "fio error: {fio}");
    assert_eq!(f[3], "800", "fio wrote 200 × 4 KiB: {fio}");
    assert_eq!(f[2], "800", "fio verified 200 × 4 KiB by reading: {fio}");
    assert!(log.contains("dd: 20+0 records in"), "{log}");
    r
}

fn check_kernel(name: &str, kernel: GuestKernel, release_prefix: &str) {
    let r = run_direct_io(
        name,
        VmConfig {
            guest_kernel: kernel.clone(),
            ..VmConfig::default()
        },
    );
    assert!(
        r.kernel_release.starts_with(release_prefix) && kernel.matches_release(&r.kernel_release),
        "{kernel} booted {}",
        r.kernel_release
    );
}

#[test]
fn guest_kernel_5_10_bullseye() {
    check_kernel("kernel-5.10", GuestKernel::V5_10, "5.10.");
}

#[test]
fn guest_kernel_6_12_trixie() {
    check_kernel("kernel-6.12", GuestKernel::V6_12, "6.12.");
}

#[test]
fn guest_kernel_newest_sid() {
    check_kernel("kernel-sid", GuestKernel::V7, "7.");
}

#[test]
fn qemu_10_0_bookworm_backports() {
    let r = run_direct_io(
        "qemu-10.0",
        VmConfig {
            qemu: QemuBuild::V10_0,
            ..VmConfig::default()
        },
    );
    assert!(r.qemu_version.starts_with("10.0."), "{}", r.qemu_version);
}

/// What the host sees of a running QEMU: its root and whether its binary is the host's
/// file at the same path.
#[derive(Debug)]
struct Seen {
    root: PathBuf,
    /// The lab's sid root carries a `viotrace-ok` marker.
    root_is_the_sid_root: bool,
    exe: PathBuf,
    exe_is_hosts_file: bool,
    exe_under_root: bool,
}

fn watch_qemu(needle: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Option<Seen>> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            for pid in qemu_processes_named(&needle) {
                let p = PathBuf::from(format!("/proc/{pid}"));
                let (Ok(exe), Ok(root), Ok(md)) = (
                    fs::read_link(p.join("exe")),
                    fs::read_link(p.join("root")),
                    fs::metadata(p.join("exe")),
                ) else {
                    continue;
                };
                if exe.file_name().is_none_or(|n| n != "qemu-system-x86_64") {
                    continue; // the namespace wrapper before its exec
                }
                let same = |m: &fs::Metadata| m.dev() == md.dev() && m.ino() == md.ino();
                let under_root = p.join("root").join(exe.strip_prefix("/").unwrap_or(&exe));
                return Some(Seen {
                    root_is_the_sid_root: p.join("root/viotrace-ok").exists(),
                    exe_is_hosts_file: fs::metadata(&exe).is_ok_and(|m| same(&m)),
                    exe_under_root: fs::metadata(under_root).is_ok_and(|m| same(&m)),
                    root,
                    exe,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    })
}

#[test]
fn qemu_11_sid_runs_from_its_own_root() {
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_qemu("-name guest=vt-qemu-11.x,".into(), stop.clone());
    let r = run_direct_io(
        "qemu-11.x",
        VmConfig {
            qemu: QemuBuild::V11,
            ..VmConfig::default()
        },
    );
    stop.store(true, Ordering::SeqCst);
    assert!(r.qemu_version.starts_with("11."), "{}", r.qemu_version);
    let seen = watcher
        .join()
        .unwrap()
        .expect("the QEMU process was never seen running");
    // Containerised: /proc/PID/exe names /usr/bin/qemu-system-x86_64, which on the host is
    // another file (or none); the binary is only reachable through /proc/PID/root.
    assert_eq!(
        seen.exe,
        Path::new("/usr/bin/qemu-system-x86_64"),
        "{seen:?}"
    );
    assert!(!seen.exe_is_hosts_file, "{seen:?}");
    assert!(seen.exe_under_root, "{seen:?}");
    // Pivoted into the sid root: the host sees it as the process's "/".
    assert_eq!(seen.root, Path::new("/"), "{seen:?}");
    assert!(seen.root_is_the_sid_root, "{seen:?}");
}
