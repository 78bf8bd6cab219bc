//! Known interference injected on the host during a lab run, for the why-slow
//! scenarios: a noisy neighbour on the disk that holds the VM's images, and a
//! CPU hog that starves QEMU's own threads. Each runs in the background from
//! `start` until it is dropped, in bursts (on, then off), so that a run has both
//! normal requests (the baseline) and disturbed ones.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// A background injector; stops (and joins) when dropped.
pub struct Injector {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// Bursts started.
    pub bursts: Arc<AtomicU64>,
    /// When each burst ran (Unix ns, wall clock: start, end), where the
    /// injector knows (the noisy neighbour).
    pub windows: Arc<Mutex<Vec<(i64, i64)>>>,
}

fn unix_ns() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

impl Drop for Injector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let end = Instant::now() + d;
    while !stop.load(Ordering::Relaxed) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A host process that writes 1 MiB blocks at queue depth 64 with O_DIRECT to a
/// file in `dir` (the file system of the VM's disk images) for `on`, then
/// pauses for `off`, until dropped.
pub fn noisy_neighbour(dir: &Path, on: Duration, off: Duration) -> Result<Injector> {
    let file: PathBuf = dir.join("neighbour.dat");
    let st = Command::new("fallocate")
        .args(["-l", "512M"])
        .arg(&file)
        .status()
        .context("running fallocate")?;
    if !st.success() {
        bail!("fallocate {} failed ({st})", file.display());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let bursts = Arc::new(AtomicU64::new(0));
    let windows = Arc::new(Mutex::new(Vec::new()));
    let (s, b, w) = (stop.clone(), bursts.clone(), windows.clone());
    let t = std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            let start = unix_ns();
            let child = Command::new("fio")
                .args([
                    "--name=neighbour",
                    "--rw=randwrite",
                    "--bs=1M",
                    "--direct=1",
                    "--ioengine=libaio",
                    "--iodepth=64",
                    "--size=512M",
                    "--time_based",
                    "--output=/dev/null",
                ])
                .arg(format!("--filename={}", file.display()))
                .arg(format!("--runtime={}ms", on.as_millis()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            if let Ok(mut c) = child {
                b.fetch_add(1, Ordering::Relaxed);
                while !s.load(Ordering::Relaxed) {
                    if let Ok(Some(_)) = c.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = c.kill();
                let _ = c.wait();
                w.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((start, unix_ns()));
            }
            sleep_unless(&s, off);
        }
        let _ = std::fs::remove_file(&file);
    });
    Ok(Injector {
        stop,
        threads: vec![t],
        bursts,
        windows,
    })
}

/// The threads of process `pid`: (tid, name).
fn threads(pid: u32) -> Vec<(u32, String)> {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let tid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            Some((tid, comm.trim().to_string()))
        })
        .collect()
}

fn pin(tid: u32, cpu: usize) -> nix::Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    sched_setaffinity(Pid::from_raw(tid as i32), &set)
}

/// Makes the calling thread SCHED_FIFO at priority 1.
fn make_fifo() -> Result<()> {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: plain FFI call on the calling thread (pid 0) with a valid, initialised
    // sched_param that outlives the call.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc != 0 {
        bail!(
            "sched_setscheduler(SCHED_FIFO): {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Starves QEMU `pid` of CPU: its vCPU threads (`CPU n/…`) are kept on CPU 0,
/// every other thread (main loop, I/O threads, thread-pool workers, re-pinned as
/// they appear) on CPU 1, where a SCHED_FIFO thread named `cpu-hog` spins for
/// `spin` out of every `period`. Needs two CPUs and root.
pub fn starve_qemu(pid: u32, spin: Duration, period: Duration) -> Result<Injector> {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        bail!("starving QEMU needs 2 CPUs");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let bursts = Arc::new(AtomicU64::new(0));
    let s = stop.clone();
    let pinner = std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            for (tid, comm) in threads(pid) {
                let _ = pin(tid, if comm.starts_with("CPU ") { 0 } else { 1 });
            }
            sleep_unless(&s, Duration::from_millis(100));
        }
    });
    let (s, b) = (stop.clone(), bursts.clone());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let hog = std::thread::Builder::new()
        .name("cpu-hog".into())
        .spawn(move || {
            let setup = pin(0, 1)
                .map_err(anyhow::Error::from)
                .and_then(|_| make_fifo());
            let ok = setup.is_ok();
            let _ = ready_tx.send(setup);
            if !ok {
                return;
            }
            while !s.load(Ordering::Relaxed) {
                b.fetch_add(1, Ordering::Relaxed);
                let end = Instant::now() + spin;
                while Instant::now() < end {
                    std::hint::spin_loop();
                }
                std::thread::sleep(period.saturating_sub(spin));
            }
        })
        .context("starting the CPU hog")?;
    let inj = Injector {
        stop,
        threads: vec![pinner, hog],
        bursts,
        windows: Arc::default(),
    };
    ready_rx
        .recv()
        .context("the CPU hog did not start")?
        .context("setting up the CPU hog")?;
    Ok(inj)
}
