//! Child processes that never outlive the lab: they get SIGKILL when the lab dies
//! (PR_SET_PDEATHSIG), live in their own process group (so a terminal's Ctrl-C
//! reaches the lab first and the lab decides the order of shutdown), and are
//! terminated and reaped when their guard is dropped.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A running child that is killed and reaped on drop.
pub struct Guarded {
    pub name: String,
    child: Option<Child>,
    status: Option<ExitStatus>,
}

impl Guarded {
    /// Spawns `cmd` guarded.
    pub fn spawn(name: &str, cmd: &mut Command) -> Result<Guarded> {
        cmd.process_group(0);
        // SAFETY: the closure runs between fork and exec and only calls prctl(2) and
        // getppid(2), both async-signal-safe; it touches no Rust state.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect.
                if libc::getppid() == 1 {
                    return Err(std::io::Error::other("parent exited"));
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name} ({:?})", cmd.get_program()))?;
        Ok(Guarded {
            name: name.to_string(),
            child: Some(child),
            status: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Non-blocking: has the child exited?
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_some() {
            return Ok(self.status);
        }
        if let Some(c) = self.child.as_mut() {
            if let Some(st) = c.try_wait()? {
                self.status = Some(st);
            }
        }
        Ok(self.status)
    }

    /// Sends a signal to the child (ignored if it already exited).
    pub fn signal(&mut self, sig: Signal) {
        if self.try_wait().ok().flatten().is_none() {
            let _ = kill(Pid::from_raw(self.pid() as i32), sig);
        }
    }

    /// Waits up to `timeout` for the child to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.try_wait()? {
                return Ok(Some(st));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asks politely (`sig`), then SIGKILL after `grace`; always reaps.
    pub fn stop(&mut self, sig: Signal, grace: Duration) -> Result<ExitStatus> {
        self.signal(sig);
        if let Some(st) = self.wait_timeout(grace)? {
            return Ok(st);
        }
        self.signal(Signal::SIGKILL);
        let st = self
            .child
            .as_mut()
            .context("no child")?
            .wait()
            .with_context(|| format!("wait for {}", self.name))?;
        self.status = Some(st);
        Ok(st)
    }

    /// Takes the child's stderr (for readers).
    pub fn take_stderr(&mut self) -> Option<std::process::ChildStderr> {
        self.child.as_mut().and_then(|c| c.stderr.take())
    }

    /// Takes the child's stdout (for readers).
    pub fn take_stdout(&mut self) -> Option<std::process::ChildStdout> {
        self.child.as_mut().and_then(|c| c.stdout.take())
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.stop(Signal::SIGTERM, Duration::from_secs(3));
        }
    }
}
