//! One lab run, in phases: the guest's initramfs and the data disk, the vsock
//! backend, the QEMU command line, QEMU and its console (markers, host agent
//! attach and restarts, the deadline), stopping everything, and the results.
//! Every helper process is a [`Guarded`] child: whatever path a run leaves by,
//! nothing it started outlives it.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::sys::signal::Signal;

use crate::assets;
use crate::config::{HostAttach, VmConfig, VsockMode};
use crate::cpu_split;
use crate::host_bpf::{self, StatsOn, MARK_HOST_BPF};
use crate::host_threads::{self, HostThreads, Snapshot};
use crate::metrics::{ProcSample, RunMetrics, Usage};
use crate::proc::Guarded;
use crate::qmp::Qmp;
use crate::result::{write_summary, RunResult};
use crate::vm::{
    mono_at, tail, Lab, MARK_AGENT_EXIT, MARK_AGENT_FAILED, MARK_BOOTED, MARK_DONE, MARK_END,
    MARK_ERROR, MARK_HOST_RESTART, MARK_QEMU_IO, MARK_START,
};

mod setup;

enum Event {
    Line(Instant, String),
    Eof,
}

/// QEMU's and the host agent's CPU and memory at one instant.
type Sample = (Option<ProcSample>, Option<ProcSample>);

/// What the console said so far, and the host agent's incarnations.
#[derive(Default)]
struct Console {
    /// Init said the guest booted (`MARK_BOOTED`).
    booted: bool,
    t_start: Option<Instant>,
    t_end: Option<Instant>,
    rc: Option<i32>,
    done: bool,
    guest_errors: Vec<String>,
    guest_agent_rc: Option<i32>,
    host_agent: Option<Guarded>,
    host_agent_pid: Option<u32>,
    /// (QEMU, host agent) at the workload's start and end.
    samples: (Sample, Sample),
    /// The host threads at the workload's start and end.
    threads: (Snapshot, Snapshot),
    backend_pid: Option<u32>,
    mono: (u64, u64),
    host_restarts: u32,
    /// Exit codes of the host agent's earlier incarnations.
    host_agent_rcs: Vec<Option<i32>>,
    /// The host's BPF accounting, on between the guest's two sample lines.
    host_bpf_stats: Option<StatsOn>,
    /// The workload's qemu-io commands, each with its outcome (`qemu-io.txt`).
    qemu_io: Vec<String>,
    /// The host agent's CPU sampled in the accounting pass (`sample_host_cpu`),
    /// and its user/kernel split once the pass ended.
    host_cpu: Option<cpu_split::Sampler>,
    host_split: Option<cpu_split::Split>,
}

/// How the console loop ended.
enum Ended {
    /// QEMU exited (its console closed first).
    Exited(ExitStatus),
    /// A deadline passed (`boot_hang`: the guest did not boot within `boot_timeout`) or
    /// the run was interrupted.
    Stopped { interrupted: bool, boot_hang: bool },
}

pub(crate) struct Run<'a> {
    pub lab: &'a Lab,
    pub cfg: &'a VmConfig,
    pub out: &'a Path,
    /// The run's private directory (initramfs, disks, sockets).
    pub rd: &'a Path,
}

impl Run<'_> {
    pub fn execute(&self, workload: &str) -> Result<RunResult> {
        let (cfg, out) = (self.cfg, self.out);
        let t_all = Instant::now();
        let guest_bin = cfg
            .agents
            .guest()
            .then(|| {
                cfg.guest_bin
                    .clone()
                    .map_or_else(assets::guest_agent_binary, Ok)
            })
            .transpose()?;
        let host_bin = cfg
            .agents
            .host()
            .then(|| {
                cfg.host_bin
                    .clone()
                    .map_or_else(assets::host_agent_binary, Ok)
            })
            .transpose()?;
        let guest = self.lab.guest(&cfg.guest_kernel)?;
        let initrd = self.initrd(workload, &guest, guest_bin.as_deref())?;
        let disk = self.data_disk()?;
        // One lab VM at a time on this machine, from here until the VM is gone.
        let _vm_lock = match &self.lab.vm_lock {
            Some(p) => Some(crate::vmlock::acquire(p)?),
            None => None,
        };
        if cfg.pin_vcpus {
            crate::pin::keep_off_vcpu_cpus(cfg.smp as usize)?;
        }
        let mut vs = self.vsock()?;
        let qemu_build = self.lab.qemu(&cfg.qemu)?;
        let paused = host_bin.is_some() && cfg.host_attach == HostAttach::Paused;
        let (mut q, accel) = self.qemu_command(&qemu_build, &guest, &initrd, &disk, &vs, paused)?;
        let hybrid_uds = (vs.mode != VsockMode::Kernel).then_some(vs.uds.as_path());
        let mut con = Console::default();
        // Host agent in discovery mode: up before QEMU exists.
        if let (Some(hb), HostAttach::BeforeQemu) = (&host_bin, cfg.host_attach) {
            con.host_agent = Some(
                self.lab
                    .start_host_agent(cfg, hb, None, out, self.rd, hybrid_uds, 0)?,
            );
        }
        let t_qemu = Instant::now();
        let mut qemu = Guarded::spawn("qemu-system-x86_64", &mut q)?;
        let qemu_pid = qemu.pid();
        let (rx, reader) = serial_reader(&mut qemu, out.join("serial.log"), cfg.console)?;
        // The host agent attached to this QEMU by pid (incarnation 0, or a restart).
        let attach = |hb: &Path, incarnation: u32| {
            self.lab.start_host_agent(
                cfg,
                hb,
                Some(qemu_pid),
                out,
                self.rd,
                hybrid_uds,
                incarnation,
            )
        };
        // Host agent by pid on the paused VM, then resume.
        // QMP answering proves the pid is QEMU itself (a rooted QEMU is exec'd by a wrapper).
        let mut t_resume = t_qemu;
        if let (Some(hb), HostAttach::Paused) = (&host_bin, cfg.host_attach) {
            let mut qmp = Qmp::connect(&self.rd.join("qmp.sock"), Duration::from_secs(30))
                .with_context(|| {
                    format!("QEMU did not start: {}", tail(&out.join("qemu.log"), 10))
                })?;
            con.host_agent = Some(attach(hb, 0)?);
            qmp.execute("cont")?;
            t_resume = Instant::now();
        }
        if cfg.pin_vcpus {
            let at = crate::pin::pin_vcpu_threads(&self.rd.join("qmp.sock"), cfg.smp as usize)?;
            fs::write(out.join("pin.txt"), at)?;
        }
        con.host_agent_pid = con.host_agent.as_ref().map(|h| h.pid());
        con.backend_pid = vs.backend.as_ref().map(|b| b.pid());
        let on_line = |con: &mut Console, t: Instant, line: &str| -> Result<()> {
            self.on_line(con, t, line, qemu_pid, host_bin.as_deref(), &attach)
        };
        let deadlines = (
            t_resume + cfg.timeout.min(cfg.boot_timeout),
            t_resume + cfg.timeout,
        );
        let ended = self.console_loop(&mut con, &rx, &mut qemu, deadlines, on_line)?;
        let qemu_status = match ended {
            Ended::Exited(st) => st,
            Ended::Stopped {
                interrupted,
                boot_hang,
            } => {
                let backend = vs.backend.take();
                return Err(self.stop_all(interrupted, boot_hang, &mut con, qemu, backend, reader));
            }
        };
        let _ = reader.join();
        let host_agent_rc = stop_host_agents(&mut con)?;
        if let Some(mut b) = vs.backend.take() {
            let _ = b.stop(Signal::SIGTERM, Duration::from_secs(2));
        }
        self.unpack_results()?;
        if !con.qemu_io.is_empty() {
            fs::write(out.join("qemu-io.txt"), con.qemu_io.join("\n") + "\n")?;
        }
        self.check_completed(&con, qemu_status)?;
        let t_start = con.t_start.unwrap_or(t_resume);
        let t_end = con.t_end.unwrap_or(t_start);
        let result = RunResult {
            out_dir: out.to_path_buf(),
            workload_rc: con.rc.unwrap_or(255),
            boot_secs: (t_start - t_resume).as_secs_f64(),
            workload_secs: (t_end - t_start).as_secs_f64(),
            total_secs: t_all.elapsed().as_secs_f64(),
            accel: accel.to_string(),
            vsock: format!("{:?}", vs.mode),
            kernel_release: guest.kernel.release.clone(),
            qemu_version: qemu_build.version.clone(),
            host_kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            qemu_pid,
            guest_agent_rc: con.guest_agent_rc,
            host_agent_rc,
            metrics: run_metrics(out, &con, (t_start, t_end)),
            workload_start_ns: con.mono.0,
            workload_end_ns: con.mono.1,
            config: cfg.clone(),
        };
        write_summary(&result)?;
        Ok(result)
    }

    /// A run stopped before QEMU exited (a deadline, or interrupted): QEMU, the
    /// host agent and the vsock backend stopped, and the error that says why
    /// (with QEMU's virtio-blk queues when it was not interrupted).
    fn stop_all(
        &self,
        interrupted: bool,
        boot_hang: bool,
        con: &mut Console,
        mut qemu: Guarded,
        backend: Option<Guarded>,
        reader: JoinHandle<Result<()>>,
    ) -> anyhow::Error {
        let virtio = (!interrupted).then(|| self.virtio_state());
        if let Err(e) = qemu.stop(Signal::SIGTERM, Duration::from_secs(2)) {
            return e;
        }
        if let Some(mut h) = con.host_agent.take() {
            let _ = h.stop(Signal::SIGINT, Duration::from_secs(10));
        }
        if let Some(mut b) = backend {
            let _ = b.stop(Signal::SIGTERM, Duration::from_secs(2));
        }
        let _ = reader.join();
        let mut msg = self.stopped_message(interrupted, boot_hang, con.t_start.is_some());
        if let Some(v) = virtio {
            msg += &format!("\nQEMU's virtio-blk queues then (virtio-state.json):\n{v}");
        }
        if boot_hang {
            return anyhow::Error::new(crate::vm::BootHang(msg));
        }
        anyhow::anyhow!(msg)
    }

    /// Reads the console until QEMU exits, the deadline passes (the first: to boot; the
    /// second: the run's) or the run is interrupted.
    fn console_loop(
        &self,
        con: &mut Console,
        rx: &mpsc::Receiver<Event>,
        qemu: &mut Guarded,
        (boot_deadline, deadline): (Instant, Instant),
        mut on_line: impl FnMut(&mut Console, Instant, &str) -> Result<()>,
    ) -> Result<Ended> {
        let mut eof = false;
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(Event::Line(t, line)) => on_line(con, t, &line)?,
                Ok(Event::Eof) => eof = true,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => eof = true,
            }
            // When QEMU exits its stdout closes: the reader's Eof ends the loop
            // after every console line has gone through the marker parsing.
            if eof {
                if let Some(st) = qemu.wait_timeout(Duration::from_secs(10))? {
                    return Ok(Ended::Exited(st));
                }
            }
            let interrupted = self.lab.interrupt.load(Ordering::SeqCst);
            let boot_hang = !con.booted && !interrupted && Instant::now() >= boot_deadline;
            if boot_hang || Instant::now() >= deadline || interrupted {
                return Ok(Ended::Stopped {
                    interrupted,
                    boot_hang,
                });
            }
        }
    }

    /// The host agent's CPU sampled by perf (`sample_host_cpu`) between the
    /// accounting pass's `start` and `end` lines, outside the measured window:
    /// the sampling costs the sampled threads about a fifth more run time on
    /// this nested host (its timer is reprogrammed at every context switch).
    /// A sampler that fails leaves the split to the ticks, and says why in
    /// `host-agent-cpu.err`.
    fn sample_host_cpu(&self, con: &mut Console, label: &str) {
        let res = match (label, con.host_agent_pid) {
            ("start", Some(pid)) if self.cfg.sample_host_cpu && con.host_cpu.is_none() => {
                let data = self.out.join("host-agent.perf.data");
                cpu_split::Sampler::start(pid, &data).map(|s| con.host_cpu = Some(s))
            }
            ("end", _) => match con.host_cpu.take() {
                Some(c) => c.stop().map(|s| con.host_split = Some(s)),
                None => Ok(()),
            },
            _ => Ok(()),
        };
        if let Err(e) = res {
            let _ = fs::write(self.out.join("host-agent-cpu.err"), format!("{e:#}\n"));
        }
    }

    /// One console line: the workload's and the guest agent's markers.
    fn on_line(
        &self,
        con: &mut Console,
        t: Instant,
        line: &str,
        qemu_pid: u32,
        host_bin: Option<&Path>,
        attach: &dyn Fn(&Path, u32) -> Result<Guarded>,
    ) -> Result<()> {
        let sample = |hp: Option<u32>| {
            (
                ProcSample::of_pid(qemu_pid),
                hp.and_then(ProcSample::of_pid),
            )
        };
        let threads = |con: &Console| {
            let mut procs = vec![("qemu", qemu_pid)];
            procs.extend(con.host_agent_pid.map(|p| ("host-agent", p)));
            procs.extend(con.backend_pid.map(|p| ("vsock-backend", p)));
            host_threads::snapshot(&procs)
        };
        if line.contains(MARK_BOOTED) {
            con.booted = true;
        } else if line.contains(MARK_START) {
            con.booted = true;
            con.t_start = Some(t);
            con.mono.0 = mono_at(t);
            if let (Some(hb), HostAttach::Running) = (host_bin, self.cfg.host_attach) {
                let h = attach(hb, 0)?;
                con.host_agent_pid = Some(h.pid());
                con.host_agent = Some(h);
            }
            con.samples.0 = sample(con.host_agent_pid);
            con.threads.0 = threads(con);
        } else if let Some(r) = line.split_once(MARK_END) {
            con.t_end = Some(t);
            con.mono.1 = mono_at(t);
            con.samples.1 = sample(con.host_agent_pid);
            con.threads.1 = threads(con);
            // (kept as the guest agent's is: the tests read its THP setting)
            if let Some(p) = con.host_agent_pid {
                let _ = fs::copy(
                    format!("/proc/{p}/status"),
                    self.out.join("host-agent.end.status"),
                );
            }
            con.rc = r.1.trim().strip_prefix("rc=").and_then(|x| x.parse().ok());
        } else if line.contains(MARK_HOST_RESTART) {
            if let (Some(hb), Some(mut h)) = (host_bin, con.host_agent.take()) {
                let st = h.stop(Signal::SIGINT, Duration::from_secs(30))?;
                con.host_restarts += 1;
                con.host_agent_rcs.push(st.code());
                let h = attach(hb, con.host_restarts)?;
                con.host_agent_pid = Some(h.pid());
                con.host_agent = Some(h);
            }
        } else if let Some((_, cmd)) = line.split_once(MARK_QEMU_IO) {
            con.qemu_io.push(self.qemu_io(cmd.trim()));
        } else if let Some((_, label)) = line.split_once(MARK_HOST_BPF) {
            let (pid, on) = (con.host_agent_pid, &mut con.host_bpf_stats);
            host_bpf::on_marker(label.trim(), pid, on, self.out);
            self.sample_host_cpu(con, label.trim());
        } else if line.contains(MARK_DONE) {
            con.done = true;
        } else if line.contains(MARK_ERROR) || line.contains(MARK_AGENT_FAILED) {
            con.guest_errors.push(line.trim().to_string());
        } else if let Some(r) = line.split_once(MARK_AGENT_EXIT) {
            con.guest_agent_rc = r.1.trim().strip_prefix("rc=").and_then(|x| x.parse().ok());
        }
        Ok(())
    }

    /// A qemu-io command on the data disk (`VIOTRACE-QEMU-IO`, with `blkdebug`), through
    /// QMP's human monitor: what it printed, or why it could not run.
    fn qemu_io(&self, cmd: &str) -> String {
        let run = || -> Result<String> {
            anyhow::ensure!(self.cfg.blkdebug, "the data disk is not behind blkdebug");
            anyhow::ensure!(!cmd.contains('"'), "a qemu-io command without quotes");
            let mut q = Qmp::connect(&self.rd.join("qmp.sock"), Duration::from_secs(5))?;
            let line = format!("qemu-io data \"{cmd}\"");
            let r = q.execute_with(
                "human-monitor-command",
                serde_json::json!({ "command-line": line }),
            )?;
            Ok(r.as_str().unwrap_or_default().trim().to_string())
        };
        match run() {
            Ok(out) => format!("{cmd}: ok {out}"),
            Err(e) => format!("{cmd}: FAILED {e:#}"),
        }
    }

    /// A hung run's virtio-blk queues as QEMU sees them, into `virtio-state.json`; one
    /// line per queue, or why they could not be read.
    fn virtio_state(&self) -> String {
        let read = || -> Result<Vec<String>> {
            let mut q = Qmp::connect(&self.rd.join("qmp.sock"), Duration::from_secs(2))?;
            let (lines, raw) = crate::qmp::virtio_queues(&mut q, "virtio-blk")?;
            fs::write(
                self.out.join("virtio-state.json"),
                serde_json::to_string_pretty(&raw)?,
            )?;
            Ok(lines)
        };
        match read() {
            Ok(l) => l.join("\n"),
            Err(e) => format!("(not read: {e:#})"),
        }
    }

    fn stopped_message(&self, interrupted: bool, boot_hang: bool, started: bool) -> String {
        let what = if interrupted {
            "interrupted".to_string()
        } else if boot_hang {
            format!(
                "did not boot within {} (no {MARK_BOOTED} line)",
                humantime::format_duration(self.cfg.boot_timeout)
            )
        } else {
            format!(
                "timed out after {} ({})",
                humantime::format_duration(self.cfg.timeout),
                if started {
                    "the workload did not finish"
                } else {
                    "the guest never started the workload"
                }
            )
        };
        format!(
            "lab VM {what}; QEMU and helpers stopped. Last serial lines:\n{}",
            crate::vm::serial_tail(&self.out.join("serial.log"), 40)
        )
    }

    /// Unpacks the results the guest shipped over its serial port.
    fn unpack_results(&self) -> Result<()> {
        let tarball = self.rd.join("results.tar");
        if tarball.exists() && fs::metadata(&tarball)?.len() > 0 {
            let mut ar = tar::Archive::new(File::open(&tarball)?);
            ar.unpack(self.out)
                .context("unpack the results the guest shipped (truncated?)")?;
        }
        if self.cfg.guest_capture && self.cfg.decode_capture {
            crate::records::decode_capture(self.out)?;
        }
        Ok(())
    }

    /// Fails the run when the guest did not finish it or reported errors.
    fn check_completed(&self, con: &Console, qemu_status: ExitStatus) -> Result<()> {
        let out = self.out;
        if !con.done || con.t_start.is_none() {
            let qerr = tail(&out.join("qemu.log"), 10);
            bail!(
                "the guest did not complete the run (QEMU {qemu_status}){}{}. Last serial lines:\n{}",
                if con.guest_errors.is_empty() {
                    String::new()
                } else {
                    format!("; guest said: {}", con.guest_errors.join("; "))
                },
                if qerr.is_empty() {
                    String::new()
                } else {
                    format!("; QEMU said: {qerr}")
                },
                tail(&out.join("serial.log"), 25)
            );
        }
        if !con.guest_errors.is_empty() {
            bail!(
                "the guest reported errors: {}\nguest agent log:\n{}",
                con.guest_errors.join("; "),
                tail(&out.join("guest.log"), 20)
            );
        }
        Ok(())
    }
}

/// Stops the host agent; an earlier incarnation that failed makes the whole
/// run's host agent status fail.
fn stop_host_agents(con: &mut Console) -> Result<Option<i32>> {
    let mut rc = None;
    if let Some(mut h) = con.host_agent.take() {
        rc = h.stop(Signal::SIGINT, Duration::from_secs(30))?.code();
    }
    if let Some(bad) = con.host_agent_rcs.iter().find(|rc| **rc != Some(0)) {
        rc = Some(bad.unwrap_or(-1));
    }
    Ok(rc)
}

/// The run's resource use over the workload window `(start, end)`.
fn run_metrics(out: &Path, con: &Console, (t_start, t_end): (Instant, Instant)) -> RunMetrics {
    let (s_start, s_end) = con.samples;
    RunMetrics {
        qemu: Usage::between(s_start.0, s_end.0),
        host_agent: Usage::between(s_start.1, s_end.1),
        host_agent_split: con.host_split,
        guest_agent: Usage::between(
            ProcSample::from_files(out, "guest-agent.start"),
            ProcSample::from_files(out, "guest-agent.end"),
        ),
        host_threads: con.t_end.map(|_| {
            HostThreads::between(
                &con.threads.0,
                &con.threads.1,
                (t_end - t_start).as_secs_f64(),
            )
        }),
    }
}

/// Copies QEMU's console to `serial.log` (and the terminal with `echo`) and
/// sends each line, then the end of the console, to the run.
fn serial_reader(
    qemu: &mut Guarded,
    serial_path: PathBuf,
    echo: bool,
) -> Result<(mpsc::Receiver<Event>, JoinHandle<Result<()>>)> {
    let (tx, rx) = mpsc::channel();
    let stdout = qemu.take_stdout().context("QEMU stdout")?;
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
    Ok((rx, reader))
}
