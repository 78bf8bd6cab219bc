//! The host agent's CPU time split into user and kernel mode, sampled:
//! `perf record -e task-clock -F 4999 -p PID` samples the agent's threads only
//! while they run, and each sample's instruction pointer says the mode. The
//! kernel's own split (utime and stime in `/proc/PID/stat`) comes from
//! scheduler ticks: over a bench window the joined agent runs for about 10
//! ticks, and the split moved from 0.63 to 1.00 between rounds of one run.
//! Sampling has a few hundred samples per pass, but it costs the sampled
//! threads: on this nested host about a fifth more run time (the event's timer
//! is reprogrammed at every context switch, a VM exit each). So the bench
//! samples in its accounting pass, after the measured window, and applies the
//! share to the window's run time.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::sys::signal::Signal;
use serde::Serialize;

use crate::proc::Guarded;

/// Samples per second of the agent's run time.
const FREQ: u32 = 4999;

/// Samples by mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Split {
    pub user: u64,
    pub kernel: u64,
}

impl Split {
    /// The user-mode share (None without a sample).
    pub fn user_share(&self) -> Option<f64> {
        let n = self.user + self.kernel;
        (n > 0).then(|| self.user as f64 / n as f64)
    }

    /// Counts `perf script -F ip` lines: a kernel address has its top bit set
    /// (x86-64 canonical upper half).
    pub fn of_ips(script: &str) -> Split {
        let mut s = Split::default();
        for ip in script.split_whitespace() {
            match u64::from_str_radix(ip, 16) {
                Ok(a) if a >> 63 == 1 => s.kernel += 1,
                Ok(_) => s.user += 1,
                Err(_) => {}
            }
        }
        s
    }
}

/// A running `perf record` of one process.
pub struct Sampler {
    perf: Guarded,
    data: PathBuf,
}

impl Sampler {
    /// Starts sampling `pid`; the samples go to `data`.
    pub fn start(pid: u32, data: &Path) -> Result<Sampler> {
        let mut cmd = Command::new("perf");
        cmd.args(["record", "-q", "-e", "task-clock", "-F", &FREQ.to_string()])
            .arg("-p")
            .arg(pid.to_string())
            .arg("-o")
            .arg(data)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let perf = Guarded::spawn("perf record", &mut cmd)
            .context("sampling the host agent's CPU needs perf (scripts/setup.sh installs it)")?;
        Ok(Sampler {
            perf,
            data: data.to_path_buf(),
        })
    }

    /// Stops sampling and counts the samples by mode.
    pub fn stop(mut self) -> Result<Split> {
        let st = self.perf.stop(Signal::SIGINT, Duration::from_secs(10))?;
        // (perf record writes its file out, then ends by the signal it got)
        let by_sigint = st.signal() == Some(Signal::SIGINT as i32);
        if !st.success() && !by_sigint && st.code() != Some(130) {
            bail!("perf record ended with {st}");
        }
        let out = Command::new("perf")
            .args(["script", "-F", "ip", "-i"])
            .arg(&self.data)
            .stderr(Stdio::null())
            .output()
            .context("running perf script")?;
        if !out.status.success() {
            bail!("perf script {} failed: {}", self.data.display(), out.status);
        }
        Ok(Split::of_ips(&String::from_utf8_lossy(&out.stdout)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_count_by_the_mode_of_their_address() {
        let s = Split::of_ips(
            " ffffffff816b8412\n     7f2734770350\n ffffffff821ef666\n 55d0c0ffee00\n",
        );
        assert_eq!(s, Split { user: 2, kernel: 2 });
        assert_eq!(s.user_share(), Some(0.5));
        assert_eq!(Split::default().user_share(), None);
        assert_eq!(Split::of_ips("garbage\n"), Split::default());
    }
}
