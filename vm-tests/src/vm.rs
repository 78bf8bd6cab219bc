//! Booting a lab VM, running a workload and the agents, and collecting the results.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signal::Signal;

use crate::assets::{self, Assets, Cpio, GuestAssets, GuestKernel, Qemu, QemuBuild};
pub use crate::config::{Accel, Agents, Aio, DiskFormat, HostAttach, VmConfig, VsockMode};
use crate::metrics::{ProcSample, RunMetrics, Usage};
use crate::proc::Guarded;
use crate::qmp::Qmp;
use crate::result::write_summary;
pub use crate::result::{read_jsonl, RunResult};

enum Event {
    Line(Instant, String),
    Eof,
}

const MARK_START: &str = "VIOTRACE-WORKLOAD-START";
const MARK_END: &str = "VIOTRACE-WORKLOAD-END";
const MARK_DONE: &str = "VIOTRACE-DONE";
const MARK_ERROR: &str = "VIOTRACE-ERROR";
const MARK_AGENT_FAILED: &str = "VIOTRACE-AGENT-FAILED";
const MARK_AGENT_EXIT: &str = "VIOTRACE-AGENT-EXIT";
/// A workload that prints this line gets its host agent restarted (outputs of the
/// earlier incarnations are kept as host.N.jsonl / joined.N.jsonl / host.N.log).
pub const MARK_HOST_RESTART: &str = "VIOTRACE-HOST-AGENT-RESTART";

/// The hybrid-vsock port the host agent listens on for guest agents.
pub const AGENT_VSOCK_PORT: u32 = 5515;

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Host CLOCK_MONOTONIC (ns) at the instant `t`.
fn mono_at(t: Instant) -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|ts| ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64)
        .unwrap_or(0);
    now.saturating_sub(t.elapsed().as_nanos() as u64)
}

/// Kernel vhost-vsock CIDs are global on the host: concurrent labs get distinct ones
/// (the default 3 becomes a per-run CID; an explicit other CID is kept).
fn kernel_cid(requested: u32) -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    if requested != 3 {
        return requested;
    }
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    1000 + (std::process::id() % 100_000) * 16 + n % 16
}

fn kvm_usable() -> bool {
    let cpu = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    Path::new("/dev/kvm").exists()
        && cpu
            .lines()
            .any(|l| l.starts_with("flags") && (l.contains(" vmx") || l.contains(" svm")))
}

fn kernel_vhost_vsock_usable() -> bool {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/vhost-vsock")
        .is_ok()
}

fn tail(p: &Path, n: usize) -> String {
    let s = fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The lab.
pub struct Lab {
    pub assets: Assets,
    /// Guest kernels prepared so far (the default one by [`Lab::new`]).
    guests: std::sync::Mutex<std::collections::BTreeMap<GuestKernel, GuestAssets>>,
    /// QEMU builds prepared so far.
    qemus: std::sync::Mutex<std::collections::BTreeMap<QemuBuild, Qemu>>,
    /// The machine-wide VM lock taken for each VM's lifetime (see [`crate::vmlock`]).
    vm_lock: Option<PathBuf>,
    interrupt: Arc<AtomicBool>,
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
        let res = self.run_in(cfg, workload, &out_dir, rd);
        if let Err(e) = &res {
            let _ = fs::write(out_dir.join("summary.txt"), format!("FAILED: {e:#}\n"));
        }
        res
    }

    fn run_in(&self, cfg: &VmConfig, workload: &str, out: &Path, rd: &Path) -> Result<RunResult> {
        let t_all = Instant::now();
        // Agents.
        let guest_bin = if cfg.agents.guest() {
            Some(assets::guest_agent_binary()?)
        } else {
            None
        };
        let host_bin = if cfg.agents.host() {
            Some(assets::host_agent_binary()?)
        } else {
            None
        };

        // initrd = base + per-run overlay.
        let guest = self.guest(&cfg.guest_kernel)?;
        let initrd = rd.join("initrd.cpio");
        fs::copy(&guest.base_initramfs, &initrd).context("copy base initramfs")?;
        {
            let mut f = fs::OpenOptions::new().append(true).open(&initrd)?;
            if !cfg.guest_tools.is_empty() {
                let tools = assets::tools_overlay(&self.assets.cache, &cfg.guest_tools)?;
                std::io::copy(&mut File::open(tools)?, &mut f)?;
            }
            let mut c = Cpio::new(Vec::new(), 1_000_000);
            let disk = "vda";
            let mut conf = String::new();
            conf += &format!("VIOTRACE_DISK={disk}\n");
            conf += &format!(
                "VIOTRACE_GUEST_AGENT={}\n",
                if guest_bin.is_some() { 1 } else { 0 }
            );
            let mut gargs = cfg.guest_args.clone();
            if cfg.agents == Agents::Both {
                gargs += &format!(" --connect vsock:2:{AGENT_VSOCK_PORT}");
            }
            conf += &format!("VIOTRACE_GUEST_ARGS={}\n", shell_quote(&gargs));
            conf += &format!(
                "VIOTRACE_GUEST_OUTPUT={}\n",
                if cfg.guest_json { "--json" } else { "" }
            );
            c.file("viotrace/config.sh", 0o644, conf.as_bytes())?;
            c.file(
                "viotrace/setup.sh",
                0o755,
                cfg.setup.as_deref().unwrap_or("").as_bytes(),
            )?;
            c.file("viotrace/workload.sh", 0o755, workload.as_bytes())?;
            if let Some(g) = &guest_bin {
                c.host_file("bin/viotrace-guest", g)?;
            }
            f.write_all(&c.finish()?)?;
        }

        // Data disk.
        let (golden, fmt) = match cfg.format {
            DiskFormat::Raw => (&self.assets.golden_raw, "raw"),
            DiskFormat::Qcow2 => (&self.assets.golden_qcow2, "qcow2"),
        };
        let disk = rd.join(format!("data.{fmt}"));
        fs::copy(golden, &disk).context("copy golden data disk")?;

        // One lab VM at a time on this machine, from here until the VM is gone.
        let _vm_lock = match &self.vm_lock {
            Some(p) => Some(crate::vmlock::acquire(p)?),
            None => None,
        };

        // vsock.
        let vsock = match cfg.vsock {
            VsockMode::Auto if kernel_vhost_vsock_usable() => VsockMode::Kernel,
            VsockMode::Auto => {
                if assets::find_vhost_vsock(&self.assets.cache).is_some() {
                    VsockMode::VhostUser
                } else if cfg.agents == Agents::Both {
                    assets::install_vhost_vsock(&self.assets.cache)?;
                    VsockMode::VhostUser
                } else {
                    VsockMode::None
                }
            }
            m => m,
        };
        let uds = cfg
            .vsock_uds
            .clone()
            .unwrap_or_else(|| rd.join("vsock.sock"));
        let vhost_sock = rd.join("vhost.sock");
        let mut backend = None;
        if vsock == VsockMode::VhostUser {
            let bin = assets::install_vhost_vsock(&self.assets.cache)?;
            let log = File::create(out.join("vsock-backend.log"))?;
            let mut b = Guarded::spawn(
                "vhost-device-vsock",
                Command::new(&bin)
                    .arg("--vm")
                    .arg(format!(
                        "guest-cid={},socket={},uds-path={}",
                        cfg.cid,
                        vhost_sock.display(),
                        uds.display()
                    ))
                    .stdin(Stdio::null())
                    .stdout(log.try_clone()?)
                    .stderr(log),
            )?;
            let t = Instant::now();
            while !vhost_sock.exists() {
                if let Some(st) = b.try_wait()? {
                    bail!(
                        "vhost-device-vsock exited ({st}): {}",
                        tail(&out.join("vsock-backend.log"), 10)
                    );
                }
                if t.elapsed() > Duration::from_secs(15) {
                    bail!("vhost-device-vsock did not create {}", vhost_sock.display());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            backend = Some(b);
        }

        // QEMU.
        let accel = match cfg.accel {
            Accel::Auto if kvm_usable() => "kvm",
            Accel::Auto | Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        };
        let qmp_path = rd.join("qmp.sock");
        let paused = host_bin.is_some() && cfg.host_attach == HostAttach::Paused;
        let qemu_build = self.qemu(&cfg.qemu)?;
        // A QEMU in its own root sees only the run directory: the kernel goes there too.
        let vmlinuz = if qemu_build.rooted() {
            let k = rd.join("vmlinuz");
            fs::copy(&guest.kernel.vmlinuz, &k).context("copy the guest kernel")?;
            k
        } else {
            guest.kernel.vmlinuz.clone()
        };
        let mut q = qemu_build.command(&[rd]);
        q.args([
            "-name",
            &cfg.name,
            "-accel",
            accel,
            "-nodefaults",
            "-no-reboot",
        ])
        .args(["-display", "none", "-monitor", "none", "-serial", "stdio"])
        .args(["-cpu", if accel == "kvm" { "host" } else { "max" }])
        .args(["-smp", &cfg.smp.to_string()])
        .args(["-m", &format!("{}M", cfg.memory_mib)])
        .arg("-object")
        .arg(format!(
            "memory-backend-memfd,id=mem,size={}M,share=on",
            cfg.memory_mib
        ))
        .args(["-numa", "node,memdev=mem"])
        .arg("-kernel")
        .arg(&vmlinuz)
        .arg("-initrd")
        .arg(&initrd)
        .args([
            "-append",
            "console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init tsc=reliable \
                 random.trust_cpu=on mitigations=off",
        ])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp_path.display()));
        let cache = if cfg.aio == Aio::Native {
            "none"
        } else {
            cfg.cache.as_str()
        };
        q.arg("-drive").arg(format!(
            "file={},if=none,id=data,format={fmt},aio={},cache={cache}",
            disk.display(),
            cfg.aio
        ));
        q.arg("-device").arg(format!(
            "virtio-blk-pci,drive=data,id=vdata,num-queues={}",
            cfg.queues
        ));
        if let Some(mib) = cfg.extra_disk_mib {
            let extra = rd.join(format!("extra.{fmt}"));
            if cfg.format == DiskFormat::Qcow2 {
                let st = Command::new("qemu-img")
                    .args(["create", "-q", "-f", "qcow2"])
                    .arg(&extra)
                    .arg(format!("{mib}M"))
                    .status()
                    .context("run qemu-img")?;
                anyhow::ensure!(st.success(), "qemu-img create failed");
            } else {
                File::create(&extra)?.set_len(u64::from(mib) << 20)?;
            }
            q.arg("-drive").arg(format!(
                "file={},if=none,id=extra,format={fmt},aio={},cache={cache}",
                extra.display(),
                cfg.aio
            ));
            q.arg("-device").arg(format!(
                "virtio-blk-pci,drive=extra,id=vextra,num-queues={}",
                cfg.queues
            ));
        }
        q.args(["-device", "virtio-serial-pci,id=vser"])
            .arg("-chardev")
            .arg(format!(
                "file,id=results,path={}",
                rd.join("results.tar").display()
            ))
            .args([
                "-device",
                "virtserialport,bus=vser.0,chardev=results,name=viotrace.results",
            ]);
        match vsock {
            VsockMode::VhostUser => {
                q.arg("-chardev")
                    .arg(format!("socket,id=vsockchr,path={}", vhost_sock.display()))
                    .args(["-device", "vhost-user-vsock-pci,chardev=vsockchr"]);
            }
            VsockMode::Kernel => {
                q.arg("-device")
                    .arg(format!("vhost-vsock-pci,guest-cid={}", kernel_cid(cfg.cid)));
            }
            _ => {}
        }
        if paused {
            q.arg("-S");
        }
        q.args(&cfg.qemu_args);
        let hybrid_uds = (vsock != VsockMode::Kernel).then_some(uds.as_path());
        let qlog = File::create(out.join("qemu.log"))?;
        q.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(qlog);

        // Host agent in discovery mode: up before QEMU exists.
        let mut host_agent = None;
        if let (Some(hb), HostAttach::BeforeQemu) = (&host_bin, cfg.host_attach) {
            host_agent = Some(self.start_host_agent(cfg, hb, None, out, rd, hybrid_uds, 0)?);
        }
        let t_qemu = Instant::now();
        let mut qemu = Guarded::spawn("qemu-system-x86_64", &mut q)?;
        let qemu_pid = qemu.pid();

        // Serial reader.
        let (tx, rx) = mpsc::channel();
        let stdout = qemu.take_stdout().context("QEMU stdout")?;
        let serial_path = out.join("serial.log");
        let echo = cfg.console;
        let reader = std::thread::spawn(move || -> Result<()> {
            let mut log = BufWriter::new(File::create(&serial_path)?);
            let mut r = BufReader::new(stdout);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                if r.read_until(b'\n', &mut buf)? == 0 {
                    break;
                }
                log.write_all(&buf)?;
                log.flush()?;
                let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                if echo {
                    println!("{line}");
                }
                if tx.send(Event::Line(Instant::now(), line)).is_err() {
                    break;
                }
            }
            let _ = tx.send(Event::Eof);
            Ok(())
        });

        // The host agent attached to this QEMU by pid (incarnation 0, or a restart).
        let attach_by_pid = |hb: &Path, incarnation: u32| {
            self.start_host_agent(cfg, hb, Some(qemu_pid), out, rd, hybrid_uds, incarnation)
        };

        // Host agent by pid on the paused VM, then resume.
        // QMP answering proves the pid is QEMU itself (a rooted QEMU is exec'd by a wrapper).
        let mut t_resume = t_qemu;
        if let (Some(hb), HostAttach::Paused) = (&host_bin, cfg.host_attach) {
            let mut qmp = Qmp::connect(&qmp_path, Duration::from_secs(30)).with_context(|| {
                format!("QEMU did not start: {}", tail(&out.join("qemu.log"), 10))
            })?;
            host_agent = Some(attach_by_pid(hb, 0)?);
            qmp.execute("cont")?;
            t_resume = Instant::now();
        }

        // Wait for the guest.
        let deadline = t_resume + cfg.timeout;
        let mut t_start = None;
        let mut t_end = None;
        let mut rc = None;
        let mut done = false;
        let mut guest_errors = Vec::new();
        let mut guest_agent_rc = None;
        let mut eof = false;
        let mut host_agent_pid = host_agent.as_ref().map(|h| h.pid());
        let sample = |hp: Option<u32>| {
            (
                ProcSample::of_pid(qemu_pid),
                hp.and_then(ProcSample::of_pid),
            )
        };
        let (mut s_start, mut s_end) = ((None, None), (None, None));
        let (mut mono_start, mut mono_end) = (0u64, 0u64);
        let mut host_restarts = 0u32;
        let mut host_agent_rcs: Vec<Option<i32>> = Vec::new();
        let qemu_status = loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(Event::Line(t, line)) => {
                    if line.contains(MARK_START) {
                        t_start = Some(t);
                        mono_start = mono_at(t);
                        if let (Some(hb), HostAttach::Running) = (&host_bin, cfg.host_attach) {
                            let h = attach_by_pid(hb, 0)?;
                            host_agent_pid = Some(h.pid());
                            host_agent = Some(h);
                        }
                        s_start = sample(host_agent_pid);
                    } else if let Some(r) = line.split_once(MARK_END) {
                        t_end = Some(t);
                        mono_end = mono_at(t);
                        s_end = sample(host_agent_pid);
                        rc = r.1.trim().strip_prefix("rc=").and_then(|x| x.parse().ok());
                    } else if line.contains(MARK_HOST_RESTART) {
                        if let (Some(hb), Some(mut h)) = (&host_bin, host_agent.take()) {
                            let st = h.stop(Signal::SIGINT, Duration::from_secs(30))?;
                            host_restarts += 1;
                            host_agent_rcs.push(st.code());
                            let h = attach_by_pid(hb, host_restarts)?;
                            host_agent_pid = Some(h.pid());
                            host_agent = Some(h);
                        }
                    } else if line.contains(MARK_DONE) {
                        done = true;
                    } else if line.contains(MARK_ERROR) || line.contains(MARK_AGENT_FAILED) {
                        guest_errors.push(line.trim().to_string());
                    } else if let Some(r) = line.split_once(MARK_AGENT_EXIT) {
                        guest_agent_rc =
                            r.1.trim().strip_prefix("rc=").and_then(|x| x.parse().ok());
                    }
                }
                Ok(Event::Eof) => eof = true,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => eof = true,
            }
            if eof {
                if let Some(st) = qemu.wait_timeout(Duration::from_secs(10))? {
                    break st;
                }
            }
            // When QEMU exits its stdout closes: the reader's Eof ends the loop above
            // after every console line has gone through the marker parsing.
            let interrupted = self.interrupt.load(Ordering::SeqCst);
            if Instant::now() >= deadline || interrupted {
                qemu.stop(Signal::SIGTERM, Duration::from_secs(2))?;
                if let Some(mut h) = host_agent.take() {
                    let _ = h.stop(Signal::SIGINT, Duration::from_secs(10));
                }
                if let Some(mut b) = backend.take() {
                    let _ = b.stop(Signal::SIGTERM, Duration::from_secs(2));
                }
                let _ = reader.join();
                let what = if interrupted {
                    "interrupted".to_string()
                } else {
                    format!(
                        "timed out after {} ({})",
                        humantime::format_duration(cfg.timeout),
                        if t_start.is_some() {
                            "the workload did not finish"
                        } else {
                            "the guest never started the workload"
                        }
                    )
                };
                bail!(
                    "lab VM {what}; QEMU and helpers stopped. Last serial lines:\n{}",
                    tail(&out.join("serial.log"), 25)
                );
            }
        };
        let _ = reader.join();
        let mut host_agent_rc = None;
        if let Some(mut h) = host_agent.take() {
            let st = h.stop(Signal::SIGINT, Duration::from_secs(30))?;
            host_agent_rc = st.code();
        }
        // An earlier incarnation that failed makes the whole run's host agent status fail.
        if let Some(bad) = host_agent_rcs.into_iter().find(|rc| *rc != Some(0)) {
            host_agent_rc = Some(bad.unwrap_or(-1));
        }
        if let Some(mut b) = backend.take() {
            let _ = b.stop(Signal::SIGTERM, Duration::from_secs(2));
        }

        // Results shipped by the guest.
        let tarball = rd.join("results.tar");
        if tarball.exists() && fs::metadata(&tarball)?.len() > 0 {
            let mut ar = tar::Archive::new(File::open(&tarball)?);
            ar.unpack(out)
                .context("unpack the results the guest shipped (truncated?)")?;
        }
        if !done || t_start.is_none() {
            let qerr = tail(&out.join("qemu.log"), 10);
            bail!(
                "the guest did not complete the run (QEMU {qemu_status}){}{}. Last serial lines:\n{}",
                if guest_errors.is_empty() {
                    String::new()
                } else {
                    format!("; guest said: {}", guest_errors.join("; "))
                },
                if qerr.is_empty() {
                    String::new()
                } else {
                    format!("; QEMU said: {qerr}")
                },
                tail(&out.join("serial.log"), 25)
            );
        }
        if !guest_errors.is_empty() {
            bail!(
                "the guest reported errors: {}\nguest agent log:\n{}",
                guest_errors.join("; "),
                tail(&out.join("guest.log"), 20)
            );
        }
        let t_start = t_start.unwrap_or(t_resume);
        let t_end = t_end.unwrap_or(t_start);
        let result = RunResult {
            out_dir: out.to_path_buf(),
            workload_rc: rc.unwrap_or(255),
            boot_secs: (t_start - t_resume).as_secs_f64(),
            workload_secs: (t_end - t_start).as_secs_f64(),
            total_secs: t_all.elapsed().as_secs_f64(),
            accel: accel.to_string(),
            vsock: format!("{vsock:?}"),
            kernel_release: guest.kernel.release.clone(),
            qemu_version: qemu_build.version.clone(),
            qemu_pid,
            guest_agent_rc,
            host_agent_rc,
            metrics: RunMetrics {
                qemu: Usage::between(s_start.0, s_end.0),
                host_agent: Usage::between(s_start.1, s_end.1),
                guest_agent: Usage::between(
                    ProcSample::from_files(out, "guest-agent.start"),
                    ProcSample::from_files(out, "guest-agent.end"),
                ),
            },
            workload_start_ns: mono_start,
            workload_end_ns: mono_end,
            config: cfg.clone(),
        };
        write_summary(&result)?;
        Ok(result)
    }
}

impl Lab {
    /// Starts the host agent (by pid, or in discovery mode) and waits until it is ready.
    #[allow(clippy::too_many_arguments)]
    fn start_host_agent(
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
        cmd.arg("--json").arg("--ready-file").arg(&ready);
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
