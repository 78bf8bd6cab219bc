//! Booting a lab VM, running a workload and the agents, and collecting the results.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::assets::{self, Assets, GuestAssets, GuestKernel, Qemu, QemuBuild};
pub use crate::config::{Accel, Agents, Aio, DiskFormat, HostAttach, VmConfig, VsockMode};
use crate::proc::Guarded;
pub use crate::result::{read_jsonl, RunResult};

/// Init's line once the kernel, its modules and the disks are up, before anything of the
/// run's own (set-up, agents, workload) starts.
pub(crate) const MARK_BOOTED: &str = "VIOTRACE-BOOTED";
/// The default `boot_timeout`: a guest that has not booted ([`MARK_BOOTED`]) this long
/// after QEMU resumed it has hung (it takes 3–15 s under TCG).
pub const BOOT_DEADLINE: Duration = Duration::from_secs(180);
pub(crate) const MARK_START: &str = "VIOTRACE-WORKLOAD-START";
pub(crate) const MARK_END: &str = "VIOTRACE-WORKLOAD-END";
pub(crate) const MARK_DONE: &str = "VIOTRACE-DONE";
pub(crate) const MARK_ERROR: &str = "VIOTRACE-ERROR";
pub(crate) const MARK_AGENT_FAILED: &str = "VIOTRACE-AGENT-FAILED";
pub(crate) const MARK_AGENT_EXIT: &str = "VIOTRACE-AGENT-EXIT";
/// A workload that prints this line gets its host agent restarted (outputs of the
/// earlier incarnations are kept as host.N.jsonl / joined.N.jsonl / host.N.log).
pub const MARK_HOST_RESTART: &str = "VIOTRACE-HOST-AGENT-RESTART";
/// `VIOTRACE-QEMU-IO <command>`: a qemu-io command on the data disk of a run with
/// `blkdebug` (e.g. `break read_aio t1`, later `resume t1`: QEMU holds the next read
/// until then); each command and its outcome go to `qemu-io.txt`.
pub const MARK_QEMU_IO: &str = "VIOTRACE-QEMU-IO";

/// The hybrid-vsock port the host agent listens on for guest agents.
pub const AGENT_VSOCK_PORT: u32 = 5515;

pub(crate) fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Host CLOCK_MONOTONIC (ns) at the instant `t`.
pub(crate) fn mono_at(t: Instant) -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|ts| ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64)
        .unwrap_or(0);
    now.saturating_sub(t.elapsed().as_nanos() as u64)
}

/// Kernel vhost-vsock CIDs are global on the host: concurrent labs get distinct ones
/// (the default 3 becomes a per-run CID; an explicit other CID is kept).
pub(crate) fn kernel_cid(requested: u32) -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    if requested != 3 {
        return requested;
    }
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    1000 + (std::process::id() % 100_000) * 16 + n % 16
}

pub(crate) fn kvm_usable() -> bool {
    let cpu = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    Path::new("/dev/kvm").exists()
        && cpu
            .lines()
            .any(|l| l.starts_with("flags") && (l.contains(" vmx") || l.contains(" svm")))
}

pub(crate) fn kernel_vhost_vsock_usable() -> bool {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/vhost-vsock")
        .is_ok()
}

pub(crate) fn tail(p: &Path, n: usize) -> String {
    let s = fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The serial console's last lines for a stopped run: the last `n` before the
/// guest's hang dump, then the dump's disk and task lines (its stacks and
/// kernel log stay in serial.log).
pub(crate) fn serial_tail(p: &Path, n: usize) -> String {
    let s = fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    let Some(d) = lines
        .iter()
        .position(|l| l.starts_with("VIOTRACE-HANG-DUMP"))
    else {
        return lines[lines.len().saturating_sub(n)..].join("\n");
    };
    let mut out: Vec<&str> = lines[d.saturating_sub(n)..=d].to_vec();
    out.extend(
        lines[d + 1..]
            .iter()
            .filter(|l| l.starts_with("disk ") || l.starts_with("task "))
            .take(n),
    );
    out.push("(stacks and the kernel log's tail: serial.log)");
    out.join("\n")
}

/// The lab.
pub struct Lab {
    pub assets: Assets,
    /// Guest kernels prepared so far (the default one by [`Lab::new`]).
    guests: std::sync::Mutex<std::collections::BTreeMap<GuestKernel, GuestAssets>>,
    /// QEMU builds prepared so far.
    qemus: std::sync::Mutex<std::collections::BTreeMap<QemuBuild, Qemu>>,
    /// The machine-wide VM lock taken for each VM's lifetime (see [`crate::vmlock`]).
    pub(crate) vm_lock: Option<PathBuf>,
    pub(crate) interrupt: Arc<AtomicBool>,
}

impl Lab {
    /// Prepares (and caches) all assets, with the default guest kernel.
    pub fn new() -> Result<Lab> {
        Lab::with_kernel(&GuestKernel::default())
    }

    /// Prepares (and caches) all assets, with the guest kernel `kernel`. Runs whose
    /// [`VmConfig::guest_kernel`] differs prepare theirs on first use.
    pub fn with_kernel(kernel: &GuestKernel) -> Result<Lab> {
        let lab = Lab {
            assets: Assets::ensure()?,
            guests: Default::default(),
            qemus: Default::default(),
            vm_lock: crate::vmlock::default_lock_path(),
            interrupt: Arc::new(AtomicBool::new(false)),
        };
        lab.guest(kernel)?;
        Ok(lab)
    }

    /// The QEMU build `build` (downloaded, extracted or debootstrapped once).
    pub fn qemu(&self, build: &QemuBuild) -> Result<Qemu> {
        let mut qemus = self.qemus.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(q) = qemus.get(build) {
            return Ok(q.clone());
        }
        let q = assets::qemu::ensure_qemu(&self.assets.cache, build)
            .with_context(|| format!("prepare QEMU {build}"))?;
        qemus.insert(build.clone(), q.clone());
        Ok(q)
    }

    /// The guest kernel `kernel` and its initramfs (downloaded and built once).
    pub fn guest(&self, kernel: &GuestKernel) -> Result<GuestAssets> {
        let mut guests = self.guests.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(g) = guests.get(kernel) {
            return Ok(g.clone());
        }
        let g = GuestAssets::ensure(&self.assets.cache, kernel)
            .with_context(|| format!("prepare guest kernel {kernel}"))?;
        guests.insert(kernel.clone(), g.clone());
        Ok(g)
    }

    /// Uses `path` as the machine-wide VM lock (`None`: take no lock).
    pub fn set_vm_lock(&mut self, path: Option<PathBuf>) {
        self.vm_lock = path;
    }

    /// A flag that, once set (e.g. by a SIGINT handler), stops the run and tears the VM down.
    pub fn interrupt_flag(&self) -> Arc<AtomicBool> {
        self.interrupt.clone()
    }

    /// Boots a VM, runs `workload` (shell script text) inside it, and collects results into `out_dir`.
    pub fn run(&self, cfg: &VmConfig, workload: &str, out_dir: &Path) -> Result<RunResult> {
        let kept_panic = out_dir.join("serial.boot-panic.log");
        let kept_hang = out_dir.join("serial.boot-hang.log");
        let _ = fs::remove_file(&kept_panic);
        let _ = fs::remove_file(&kept_hang);
        let res = self.run_once(cfg, workload, out_dir);
        let serial = out_dir.join("serial.log");
        // Boots that failed before anything of the run's own started in the guest are
        // booted again once; the first boot's console is kept.
        let retry = match &res {
            // Seen once in CI: two TCG vCPUs, two queues, guest 6.1 on QEMU 7.2: the data
            // disk's first request completed in QEMU, its interrupt never came, and init
            // waited in the module's probe.
            Err(e) if e.downcast_ref::<BootHang>().is_some() => {
                let _ = fs::write(out_dir.join("boot-hang.txt"), format!("{e}\n"));
                let why = format!(
                    "the guest did not boot within {}",
                    humantime::format_duration(cfg.boot_timeout)
                );
                Some((kept_hang, why))
            }
            // Seen once in CI: guest 7.2 on two TCG vCPUs took an int3 Oops in boot-time
            // code patching, 1.3 s in, before init ran.
            Err(_) if panicked_while_booting(&fs::read_to_string(&serial).unwrap_or_default()) => {
                let why = "the guest kernel panicked while booting, before init ran";
                Some((kept_panic, why.to_string()))
            }
            _ => None,
        };
        if let Some((kept, why)) = retry {
            let _ = fs::rename(&serial, &kept);
            eprintln!(
                "viotrace-vm: {why} ({}); booting it again once",
                kept.display()
            );
            return self.run_once(cfg, workload, out_dir);
        }
        res
    }

    fn run_once(&self, cfg: &VmConfig, workload: &str, out_dir: &Path) -> Result<RunResult> {
        fs::create_dir_all(out_dir).with_context(|| format!("create {}", out_dir.display()))?;
        let out_dir = fs::canonicalize(out_dir)?;
        for f in [
            "serial.log",
            "guest.jsonl",
            "guest.log",
            "host.jsonl",
            "host.log",
            "joined.jsonl",
            "workload.log",
            "summary.txt",
            "summary.json",
            "qemu.log",
        ] {
            let _ = fs::remove_file(out_dir.join(f));
        }
        let run_dir = tempfile::Builder::new()
            .prefix(&format!("viotrace-lab-{}-", cfg.name))
            .tempdir_in(std::env::temp_dir())
            .context("create run directory")?;
        let rd = run_dir.path();
        let run = crate::run::Run {
            lab: self,
            cfg,
            out: &out_dir,
            rd,
        };
        let res = run.execute(workload);
        if let Err(e) = &res {
            let _ = fs::write(out_dir.join("summary.txt"), format!("FAILED: {e:#}\n"));
        }
        res
    }
}

/// A run stopped because the guest did not boot within its `boot_timeout` (its message
/// says what QEMU's queues held then).
#[derive(Debug)]
pub(crate) struct BootHang(pub String);

impl std::fmt::Display for BootHang {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BootHang {}

/// Whether a guest console shows a kernel panic before init printed anything of the
/// lab's (every init line starts `VIOTRACE-`): the guest died before any of our code
/// ran in it.
fn panicked_while_booting(serial: &str) -> bool {
    serial
        .find("Kernel panic")
        .is_some_and(|p| serial.find("VIOTRACE-").is_none_or(|i| p < i))
}

impl Lab {
    /// Starts the host agent (by pid, or in discovery mode) and waits until it is ready.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start_host_agent(
        &self,
        cfg: &VmConfig,
        bin: &Path,
        pid: Option<u32>,
        out: &Path,
        rd: &Path,
        uds: Option<&Path>,
        incarnation: u32,
    ) -> Result<Guarded> {
        let ready = rd.join("host.ready");
        let _ = fs::remove_file(&ready);
        let name = |base: &str, ext: &str| {
            if incarnation == 0 {
                out.join(format!("{base}.{ext}"))
            } else {
                out.join(format!("{base}.{incarnation}.{ext}"))
            }
        };
        let mut cmd = Command::new(bin);
        if let Some(pid) = pid {
            cmd.arg("--pid").arg(pid.to_string());
        }
        if cfg.host_json {
            cmd.arg("--json");
        }
        cmd.arg("--ready-file").arg(&ready);
        if cfg.agents == Agents::Both {
            match uds {
                // Hybrid vsock: guest connections to the port arrive on <uds>_<port>.
                Some(uds) => cmd.arg("--listen-uds").arg(format!(
                    "{}={}_{AGENT_VSOCK_PORT}",
                    cfg.name,
                    uds.display()
                )),
                // Kernel vhost-vsock: real AF_VSOCK on the host.
                None => cmd.arg("--listen-vsock").arg(AGENT_VSOCK_PORT.to_string()),
            };
            cmd.arg("--joined-out").arg(name("joined", "jsonl"));
        }
        let log = File::create(name("host", "log"))?;
        cmd.args(&cfg.host_args)
            .envs(cfg.host_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(File::create(name("host", "jsonl"))?);
        if cfg.console {
            cmd.stderr(Stdio::piped());
        } else {
            cmd.stderr(log.try_clone()?);
        }
        let mut h = Guarded::spawn("viotrace-host", &mut cmd)?;
        if let Some(err) = h.take_stderr() {
            // Live: the agent's tables and waterfalls on the terminal, and in host.log.
            std::thread::spawn(move || {
                let mut log = log;
                let mut r = BufReader::new(err);
                let mut line = String::new();
                while r.read_line(&mut line).unwrap_or(0) > 0 {
                    eprint!("{line}");
                    let _ = log.write_all(line.as_bytes());
                    line.clear();
                }
            });
        }
        let t = Instant::now();
        while !ready.exists() {
            if let Some(st) = h.try_wait()? {
                bail!(
                    "host agent exited before it was ready ({st}):\n{}",
                    tail(&name("host", "log"), 20)
                );
            }
            if t.elapsed() > Duration::from_secs(120) || self.interrupt.load(Ordering::SeqCst) {
                bail!(
                    "host agent not ready after {:?}:\n{}",
                    t.elapsed(),
                    tail(&name("host", "log"), 20)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_tail_keeps_the_lines_before_a_hang_dump_and_its_summary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("serial.log");
        let mut s: String = (0..50).map(|i| format!("line {i}\n")).collect();
        s += "VIOTRACE-HANG-DUMP (disks, user tasks, blocked tasks follow)\n\
              disk vda: in flight (reads writes): 1 0\n\
              task 9/9 fio [S (sleeping)] wchan=read_events: fio x\n    [<0>] read_events+0x1\n\
              kernel log, last 40 lines:\n    [ 1.0] boot\n";
        fs::write(&p, &s).unwrap();
        let t = serial_tail(&p, 3);
        let want = "line 47\nline 48\nline 49\n\
            VIOTRACE-HANG-DUMP (disks, user tasks, blocked tasks follow)\n\
            disk vda: in flight (reads writes): 1 0\n\
            task 9/9 fio [S (sleeping)] wchan=read_events: fio x\n\
            (stacks and the kernel log's tail: serial.log)";
        assert_eq!(t, want);
        // Without a dump: the plain tail.
        fs::write(&p, "a\nb\nc\n").unwrap();
        assert_eq!(serial_tail(&p, 2), "b\nc");
    }

    #[test]
    fn a_boot_panic_is_one_before_init() {
        let p = panicked_while_booting;
        let oops = "[ 1.33] Oops: int3: 0000 [#2] SMP NOPTI\n[ 1.34] Kernel panic - not syncing: Fatal exception in interrupt\n";
        assert!(p(oops));
        assert!(!p(&format!("VIOTRACE-AGENT-START\n{oops}")));
        assert!(p(&format!("{oops}VIOTRACE-ERROR late\n")));
        assert!(!p("VIOTRACE-WORKLOAD-START\nVIOTRACE-DONE\n"));
        assert!(!p(""));
    }
}
