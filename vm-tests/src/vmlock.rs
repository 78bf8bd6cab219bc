//! One lab VM at a time per machine: an exclusive `flock` on a well-known file
//! (`/tmp/viotrace-vm.lock`, the same file as the `flock /tmp/viotrace-vm.lock <command>`
//! convention) held for a VM's lifetime.
//!
//! A command already wrapped in that external `flock` must not wait for itself: the lab does
//! not take the lock when `VIOTRACE_VM_LOCK_HELD=1` is set, nor when `/proc/locks` shows the
//! lock held by one of this process's ancestors. Within one process the lock is shared: VMs
//! a program runs side by side on purpose (e.g. two VMs under one host agent) still run
//! together, and the machine never has two lab programs' VMs at once.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use nix::fcntl::{Flock, FlockArg};

/// The machine-wide lab VM lock file.
pub const VM_LOCK_PATH: &str = "/tmp/viotrace-vm.lock";

/// Set to `1` by a caller that already holds the VM lock (e.g. `flock` around the tests).
pub const VM_LOCK_HELD_ENV: &str = "VIOTRACE_VM_LOCK_HELD";

/// The default lock: `None` when the environment says it is already held for us.
pub fn default_lock_path() -> Option<PathBuf> {
    match std::env::var(VM_LOCK_HELD_ENV) {
        Ok(v) if v == "1" => None,
        _ => Some(PathBuf::from(VM_LOCK_PATH)),
    }
}

/// How this process holds the lock.
enum Holding {
    Flock(#[allow(dead_code)] Flock<File>),
    ByAncestor,
}

/// Locks this process holds: path → (users, how).
static HELD: Mutex<BTreeMap<PathBuf, (usize, Holding)>> = Mutex::new(BTreeMap::new());

fn held() -> MutexGuard<'static, BTreeMap<PathBuf, (usize, Holding)>> {
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

/// A use of the VM lock; the lock is released when the process's last use drops.
pub struct VmLock {
    path: PathBuf,
}

impl VmLock {
    /// Whether the lock is held through an ancestor (e.g. `flock(1)` around this program).
    pub fn by_ancestor(&self) -> bool {
        matches!(held().get(&self.path), Some((_, Holding::ByAncestor)))
    }
}

impl Drop for VmLock {
    fn drop(&mut self) {
        let mut h = held();
        if let Some((users, _)) = h.get_mut(&self.path) {
            *users -= 1;
            if *users == 0 {
                h.remove(&self.path);
            }
        }
    }
}

/// Takes the VM lock at `path`, waiting (with a note on stderr) while another program's
/// lab VM runs; shared with this process's other current uses.
pub fn acquire(path: &Path) -> Result<VmLock> {
    // Held while waiting: this process's other runs wait for the same lock anyway.
    let mut h = held();
    if let Some((users, _)) = h.get_mut(path) {
        *users += 1;
        return Ok(VmLock {
            path: path.to_path_buf(),
        });
    }
    let how = lock_file(path)?;
    h.insert(path.to_path_buf(), (1, how));
    Ok(VmLock {
        path: path.to_path_buf(),
    })
}

fn lock_file(path: &Path) -> Result<Holding> {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("open the lab VM lock {}", path.display()))?;
    let f = match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
        Ok(l) => return Ok(Holding::Flock(l)),
        Err((f, _)) => f,
    };
    if holder_ancestor(&f.metadata()?).is_some() {
        return Ok(Holding::ByAncestor);
    }
    eprintln!(
        "viotrace-vm: waiting for another lab VM to finish (lock {})",
        path.display()
    );
    Flock::lock(f, FlockArg::LockExclusive)
        .map(Holding::Flock)
        .map_err(|(_, e)| anyhow::anyhow!("lock {}: {e}", path.display()))
}

/// The pid of an ancestor of this process holding a `flock` on the file `md`, if any.
fn holder_ancestor(md: &fs::Metadata) -> Option<u32> {
    let locks = fs::read_to_string("/proc/locks").ok()?;
    let dev = format!(
        "{:02x}:{:02x}:{}",
        nix::sys::stat::major(md.dev()),
        nix::sys::stat::minor(md.dev()),
        md.ino()
    );
    let holders = flock_holders(&locks, &dev);
    let ancestors = ancestors(std::process::id());
    holders.into_iter().find(|h| ancestors.contains(h))
}

/// Pids holding `FLOCK` locks on the file `dev` (`maj:min:inode` as /proc/locks writes it).
fn flock_holders(locks: &str, dev: &str) -> Vec<u32> {
    locks
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "1: FLOCK  ADVISORY  WRITE 20153 fe:00:5595158 0 EOF"
            (f.len() >= 6 && f[1] == "FLOCK" && f[5] == dev)
                .then(|| f[4].parse().ok())
                .flatten()
        })
        .collect()
}

/// This process's ancestors (parent first), up to init.
fn ancestors(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut p = pid;
    while p > 1 && out.len() < 64 {
        let Some(pp) = fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .and_then(|s| parent_of(&s))
        else {
            break;
        };
        out.push(pp);
        p = pp;
    }
    out
}

/// The ppid field of /proc/PID/stat (after the parenthesised comm, which may hold spaces).
fn parent_of(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Holds the lock at `path` from another process (`flock -o PATH cat`) until the returned
/// child's stdin is closed (for tests of programs that must wait).
pub fn hold_in_other_process(path: &Path) -> Result<Child> {
    let child = Command::new("flock")
        .arg("-o")
        .arg(path)
        .arg("cat")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("run flock(1)")?;
    let md = || fs::metadata(path);
    let t = Instant::now();
    loop {
        if let Ok(m) = md() {
            let dev = format!(
                "{:02x}:{:02x}:{}",
                nix::sys::stat::major(m.dev()),
                nix::sys::stat::minor(m.dev()),
                m.ino()
            );
            let locks = fs::read_to_string("/proc/locks").unwrap_or_default();
            if flock_holders(&locks, &dev).contains(&child.id()) {
                return Ok(child);
            }
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(10),
            "flock(1) did not take {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_flock_holders_of_one_file() {
        let locks = "1: FLOCK  ADVISORY  WRITE 20153 fe:00:5595158 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 18491 fe:00:10010637 0 EOF\n\
                     3: POSIX  ADVISORY  WRITE 777 fe:00:5595158 0 EOF\n\
                     4: OFDLCK ADVISORY  READ -1 fe:00:10051617 201 201\n";
        assert_eq!(flock_holders(locks, "fe:00:5595158"), [20153]);
        assert!(flock_holders(locks, "fe:00:1").is_empty());
    }

    #[test]
    fn parent_pid_from_stat_with_odd_comm() {
        assert_eq!(parent_of("42 (a) b (c)) S 17 42 42 0"), Some(17));
        assert_eq!(parent_of("garbage"), None);
        assert!(!ancestors(std::process::id()).is_empty());
    }

    #[test]
    fn waits_for_another_program_and_shares_within_this_one() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("vm.lock");
        let mut other = hold_in_other_process(&p).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let p2 = p.clone();
        let t = std::thread::spawn(move || {
            let l = acquire(&p2).unwrap();
            tx.send(()).unwrap();
            // A second use in this process does not wait.
            let l2 = acquire(&p2).unwrap();
            assert!(!l.by_ancestor() && !l2.by_ancestor());
        });
        assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
        drop(other.stdin.take());
        assert!(other.wait().unwrap().success());
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        t.join().unwrap();
        assert!(held().get(&p).is_none(), "released with its last use");
    }
}
