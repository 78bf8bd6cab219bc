//! What a lab run leaves: its result, the summary files and the agents' JSON lines.

use std::fs::{self, File};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::metrics::RunMetrics;
use crate::vm::VmConfig;

/// The outcome of a lab run whose VM booted and finished.
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    pub out_dir: PathBuf,
    /// The workload script's exit status.
    pub workload_rc: i32,
    /// From starting (or resuming) QEMU to the workload's start, seconds.
    pub boot_secs: f64,
    /// The workload's run time, seconds.
    pub workload_secs: f64,
    /// Whole run, seconds.
    pub total_secs: f64,
    pub accel: String,
    pub vsock: String,
    /// The guest kernel's release (what `uname -r` says in the guest).
    pub kernel_release: String,
    /// QEMU's version (`x.y.z`).
    pub qemu_version: String,
    /// The host's kernel release (the host agent's BPF is verified by it); empty if unreadable.
    pub host_kernel: String,
    pub qemu_pid: u32,
    pub guest_agent_rc: Option<i32>,
    pub host_agent_rc: Option<i32>,
    /// CPU time and peak RSS of QEMU and the agents over the workload window.
    pub metrics: RunMetrics,
    /// Host CLOCK_MONOTONIC (ns) when the workload's start and end markers were seen on
    /// the console: the window in which host-side records belong to the workload.
    pub workload_start_ns: u64,
    pub workload_end_ns: u64,
    pub config: VmConfig,
}

impl RunResult {
    pub fn path(&self, name: &str) -> PathBuf {
        self.out_dir.join(name)
    }

    /// Reads a JSON-lines output of the run (`guest.jsonl`, `host.jsonl`, `joined.jsonl`).
    pub fn jsonl(&self, name: &str) -> Result<Vec<serde_json::Value>> {
        read_jsonl(&self.path(name))
    }

    /// An output file of the agents as typed records.
    pub fn records(&self, name: &str) -> Result<crate::records::Records> {
        crate::records::Records::read(&self.path(name))
    }

    pub fn workload_log(&self) -> String {
        fs::read_to_string(self.path("workload.log")).unwrap_or_default()
    }
}

/// Reads a JSON-lines file.
pub fn read_jsonl(p: &Path) -> Result<Vec<serde_json::Value>> {
    read_lines_as(p)
}

/// Reads a JSON-lines file as values of `T`, naming the line that is not one.
pub fn read_lines_as<T: serde::de::DeserializeOwned>(p: &Path) -> Result<Vec<T>> {
    let f = File::open(p).with_context(|| format!("open {}", p.display()))?;
    let mut v = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        v.push(serde_json::from_str(&line).with_context(|| {
            format!(
                "{}:{}: not a {}",
                p.display(),
                i + 1,
                std::any::type_name::<T>()
            )
        })?);
    }
    Ok(v)
}

pub(crate) fn write_summary(r: &RunResult) -> Result<()> {
    let mut s = String::new();
    s += &format!("workload exit status: {}\n", r.workload_rc);
    s += &format!("boot to workload:     {:.2} s\n", r.boot_secs);
    s += &format!("workload time:        {:.2} s\n", r.workload_secs);
    s += &format!("total run time:       {:.2} s\n", r.total_secs);
    s += &format!(
        "vm: {} vCPU, {} queue(s), aio={}, cache={}, format={:?}, accel={}, cpu={}, vsock={}\n",
        r.config.smp,
        r.config.queues,
        r.config.aio,
        r.config.cache,
        r.config.format,
        r.accel,
        crate::config::cpu_arg(r.config.cpu.as_deref(), &r.accel),
        r.vsock
    );
    s += &format!("guest kernel: {}\n", r.kernel_release);
    s += &format!("qemu: {} ({})\n", r.qemu_version, r.config.qemu);
    s += &format!("agents: {:?}", r.config.agents);
    if let Some(rc) = r.guest_agent_rc {
        s += &format!(", guest agent exit {rc}");
    }
    if let Some(rc) = r.host_agent_rc {
        s += &format!(", host agent exit {rc}");
    }
    s += "\n";
    let m = &r.metrics;
    for (what, u) in [
        ("qemu", m.qemu),
        ("host agent", m.host_agent),
        ("guest agent", m.guest_agent),
    ] {
        if let Some(u) = u {
            s += &format!(
                "{what:<12} over the workload: {:.2} s CPU, peak RSS {} KiB\n",
                u.cpu_secs, u.peak_rss_kib
            );
        }
    }
    if let Some(u) = m
        .host_agent_split
        .and_then(|x| x.user_share().map(|u| (x, u)))
    {
        s += &format!(
            "host agent   user mode {:.1} % of its CPU ({} perf samples)\n",
            100.0 * u.1,
            u.0.user + u.0.kernel
        );
    }
    if let Some(h) = &m.host_threads {
        if let Some(w) = h.vcpu_wait_share() {
            s += &format!(
                "vCPU threads waited for a host CPU {:.1} % of the window (host-threads.txt)\n",
                100.0 * w
            );
        }
        fs::write(r.path("host-threads.txt"), h.text())?;
    }
    fs::write(r.path("summary.txt"), s)?;
    fs::write(r.path("summary.json"), serde_json::to_vec_pretty(r)?)?;
    Ok(())
}
