//! Finding QEMU processes (`qemu-system-*`, RHEL's `qemu-kvm`), the binary they
//! run (also when it is only visible inside the process's root, as with a
//! containerised QEMU) and reading their memory.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use viotrace_shared::record::Backend;

use super::cmdline::{parse_cmdline, BlkDevice, Drive};
use super::layout::Layout;

/// A QEMU process we may trace.
#[derive(Clone, Debug)]
pub struct QemuProc {
    pub pid: u32,
    /// The binary the uprobes attach to and that is read for symbols: the path
    /// the process was started from when it names the same file in our mount
    /// namespace, else the same path under `/proc/PID/root`, else `/proc/PID/exe`.
    pub exe: PathBuf,
    /// How `exe` was found (for the attach message).
    pub exe_via: &'static str,
    /// VM label: `-name`, else `qemu-<pid>`.
    pub vm: String,
    pub devices: Vec<BlkDevice>,
    pub drives: Vec<Drive>,
    pub smp: Option<u16>,
}

/// Whether an executable's file name is a QEMU system emulator: `qemu-system-*`,
/// or `qemu-kvm` (RHEL/CentOS: /usr/libexec/qemu-kvm).
pub fn is_qemu_name(name: &str) -> bool {
    let name = name.strip_suffix(" (deleted)").unwrap_or(name);
    name.starts_with("qemu-system-") || name == "qemu-kvm"
}

/// Whether `pid` runs a QEMU system emulator.
pub fn is_qemu(pid: u32) -> bool {
    fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .is_some_and(|n| is_qemu_name(&n))
}

/// Every running QEMU system emulator process.
pub fn discover() -> Vec<u32> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut v: Vec<u32> = rd
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| is_qemu(pid))
        .collect();
    v.sort_unstable();
    v
}

/// Tells when a traced process has exited, without reading `/proc` each time:
/// a pidfd (Linux 5.3+), readable once the process has exited, polled with no
/// wait. Reading `/proc/PID/stat` of a QEMU with many threads sums every
/// thread's times and cost ~280 µs per read on a nested host, once a second.
/// Without a pidfd (an older kernel), [`alive`] reads `/proc/PID/stat`.
#[derive(Debug)]
pub struct Liveness {
    pid: u32,
    pidfd: Option<std::os::fd::OwnedFd>,
}

impl Liveness {
    pub fn new(pid: u32) -> Self {
        let pidfd = i32::try_from(pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .and_then(|p| {
                rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
            });
        Liveness { pid, pidfd }
    }

    /// Whether the process still runs (has not exited, not a zombie).
    pub fn alive(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        let Some(fd) = &self.pidfd else {
            return alive(self.pid);
        };
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => true,
            Ok(_) => false,
            Err(_) => alive(self.pid),
        }
    }

    /// Whether the check uses a pidfd (false: `/proc/PID/stat`).
    #[cfg(test)]
    fn has_pidfd(&self) -> bool {
        self.pidfd.is_some()
    }
}

/// Whether the process still exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X"),
        Err(_) => false,
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The path through which the binary of `pid` is read and uprobed. Uprobes attach
/// by inode, so any path naming the same file works; a path that exists here but
/// names another file (a container's `/usr/bin/qemu-system-x86_64` is not the
/// host's) must not be used.
pub fn resolve_exe(pid: u32) -> Result<(PathBuf, &'static str)> {
    let exe_link = PathBuf::from(format!("/proc/{pid}/exe"));
    let link =
        fs::read_link(&exe_link).with_context(|| format!("reading {}", exe_link.display()))?;
    Ok(choose_exe(
        &link,
        &exe_link,
        Path::new(&format!("/proc/{pid}/root")),
    ))
}

/// `link`: the text of the exe link (the path in the process's mount namespace);
/// `exe`: a path that resolves to the running file; `root`: the process's root.
fn choose_exe(link: &Path, exe: &Path, root: &Path) -> (PathBuf, &'static str) {
    let text = link.to_string_lossy();
    let link = PathBuf::from(text.strip_suffix(" (deleted)").unwrap_or(&text));
    if same_file(&link, exe) {
        return (link, "path");
    }
    let in_root = root.join(link.strip_prefix("/").unwrap_or(&link));
    if same_file(&in_root, exe) {
        return (in_root, "process root");
    }
    // Replaced or deleted binary: the magic link still names the running file.
    (exe.to_path_buf(), "/proc/PID/exe")
}

impl QemuProc {
    pub fn inspect(pid: u32) -> Result<QemuProc> {
        let (exe, exe_via) = resolve_exe(pid)?;
        let raw = fs::read(format!("/proc/{pid}/cmdline"))
            .with_context(|| format!("reading /proc/{pid}/cmdline"))?;
        let args: Vec<String> = raw
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let cl = parse_cmdline(&args);
        Ok(QemuProc {
            pid,
            exe,
            exe_via,
            vm: cl.name.unwrap_or_else(|| format!("qemu-{pid}")),
            devices: cl.devices,
            drives: cl.drives,
            smp: cl.smp,
        })
    }

    /// The backend of a device (by its drive), or of the only drive.
    pub fn backend_of(&self, dev: Option<&BlkDevice>) -> Backend {
        let drive = dev.and_then(|d| d.drive.as_deref());
        if let Some(id) = drive {
            if let Some(d) = self.drives.iter().find(|d| d.id == id) {
                return d.backend;
            }
        }
        // Unknown drive: still known when every drive uses the same mode.
        match self.drives.split_first() {
            Some((first, rest)) if rest.iter().all(|d| d.backend == first.backend) => first.backend,
            _ => Backend::Unknown,
        }
    }

    /// The most queues any virtio-blk device of this VM can have (`num-queues`,
    /// whose default is the number of vCPUs), or None when the command line does
    /// not tell.
    pub fn max_queues(&self) -> Option<u16> {
        let mut max = 0u16;
        for d in &self.devices {
            max = max.max(d.num_queues.or(self.smp)?);
        }
        (max > 0).then_some(max)
    }

    /// The largest virtqueue size of its virtio-blk devices (`queue-size`,
    /// default 256; at most 1024).
    pub fn max_queue_size(&self) -> u16 {
        self.devices
            .iter()
            .map(|d| d.queue_size.unwrap_or(256))
            .max()
            .unwrap_or(1024)
            .min(1024)
    }
}

/// Reads `len` bytes of the process's memory.
pub fn read_mem(pid: u32, addr: u64, len: usize) -> Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = fs::File::open(format!("/proc/{pid}/mem"))
        .with_context(|| format!("opening /proc/{pid}/mem"))?;
    f.seek(SeekFrom::Start(addr))?;
    let mut buf = vec![0u8; len];
    f.read_exact(&mut buf)
        .with_context(|| format!("reading {len} bytes at {addr:#x} in {pid}"))?;
    Ok(buf)
}

pub fn read_ptr(pid: u32, addr: u64) -> Option<u64> {
    let b = read_mem(pid, addr, 8).ok()?;
    Some(u64::from_le_bytes(b.try_into().ok()?))
}

pub fn read_i32(pid: u32, addr: u64) -> Option<i32> {
    let b = read_mem(pid, addr, 4).ok()?;
    Some(i32::from_le_bytes(b.try_into().ok()?))
}

fn read_cstr(pid: u32, addr: u64) -> Option<String> {
    // Small chunks: a longer read could run into an unmapped page.
    let mut out = Vec::new();
    for k in 0..8u64 {
        let b = read_mem(pid, addr + k * 16, 16).ok()?;
        match b.iter().position(|&c| c == 0) {
            Some(end) => {
                out.extend_from_slice(&b[..end]);
                let s = String::from_utf8(out).ok()?;
                return (!s.is_empty() && s.chars().all(|c| c.is_ascii_graphic())).then_some(s);
            }
            None => out.extend_from_slice(&b),
        }
    }
    None
}

/// The drive (BlockBackend name, i.e. the `-drive id=`) behind a virtio-blk device.
pub fn device_drive(pid: u32, vdev: u64, l: &Layout) -> Option<String> {
    if vdev == 0 {
        return None;
    }
    let blk = read_ptr(pid, vdev + u64::from(l.vblk_blk)).filter(|&p| p != 0)?;
    let name = read_ptr(pid, blk + u64::from(l.blk_name)).filter(|&p| p != 0)?;
    read_cstr(pid, name)
}

/// What an fd of a process is (`anon_inode:[eventfd]`, a path, …).
pub fn fd_target(pid: u32, fd: i32) -> Option<String> {
    fs::read_link(format!("/proc/{pid}/fd/{fd}"))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// utime + stime of a process, in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // after ")": state is field 3 → index 0; utime field 14 → index 11
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_follows_a_child_until_it_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let l = Liveness::new(child.id());
        assert!(l.has_pidfd(), "this kernel has pidfd_open");
        assert!(l.alive());
        child.kill().expect("kill");
        // Killed but not yet reaped (a zombie): gone already.
        let t = std::time::Instant::now();
        while l.alive() && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!l.alive(), "a killed child is not alive");
        assert!(!alive(child.id()), "the /proc check agrees");
        child.wait().expect("reap");
        assert!(!l.alive(), "nor once reaped");
        assert!(!Liveness::new(u32::MAX).alive(), "no such process");
    }

    #[test]
    fn names_of_qemu_binaries() {
        assert!(is_qemu_name("qemu-system-x86_64"));
        assert!(is_qemu_name("qemu-kvm"));
        assert!(is_qemu_name("qemu-system-aarch64 (deleted)"));
        assert!(!is_qemu_name("qemu-img"));
        assert!(!is_qemu_name("qemu-kvm-helper"));
    }

    #[test]
    fn exe_of_a_process_in_our_namespace() {
        let (p, via) = resolve_exe(std::process::id()).unwrap();
        assert_eq!(via, "path");
        assert_eq!(p, std::env::current_exe().unwrap());
    }

    /// A containerised QEMU: its exe path names, in our namespace, nothing or
    /// another file; the running file is reachable under its root.
    #[test]
    fn exe_only_visible_under_the_process_root() {
        let base = std::env::temp_dir().join(format!("viotrace-proc-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let root = base.join("root");
        let inside = root.join("usr/libexec");
        fs::create_dir_all(&inside).unwrap();
        let running = inside.join("qemu-kvm");
        fs::write(&running, b"container binary").unwrap();
        let other = base.join("host-qemu-kvm");
        fs::write(&other, b"host binary").unwrap();
        // Nothing at that path here.
        let (p, via) = choose_exe(Path::new("/usr/libexec/qemu-kvm"), &running, &root);
        assert_eq!((p.as_path(), via), (running.as_path(), "process root"));
        // Another file at that path here (the host's own QEMU): not used.
        let (p, via) = choose_exe(&other, &running, &root);
        assert_eq!((p.as_path(), via), (running.as_path(), "/proc/PID/exe"));
        // Same file: the path itself; " (deleted)" is not part of the path.
        let (p, via) = choose_exe(&running, &running, &root);
        assert_eq!((p.as_path(), via), (running.as_path(), "path"));
        let deleted = PathBuf::from(format!("{} (deleted)", running.display()));
        assert_eq!(choose_exe(&deleted, &running, &root).1, "path");
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn queue_bounds_from_the_command_line() {
        let p = |devs: Vec<BlkDevice>, smp| QemuProc {
            pid: 1,
            exe: PathBuf::new(),
            exe_via: "path",
            vm: "v".into(),
            devices: devs,
            drives: vec![],
            smp,
        };
        let d = |nq, qs| BlkDevice {
            id: None,
            drive: None,
            num_queues: nq,
            queue_size: qs,
        };
        assert_eq!(p(vec![d(Some(2), None)], None).max_queues(), Some(2));
        assert_eq!(p(vec![d(None, None)], Some(4)).max_queues(), Some(4));
        assert_eq!(p(vec![d(None, None)], None).max_queues(), None);
        assert_eq!(p(vec![d(None, Some(128))], None).max_queue_size(), 128);
        assert_eq!(p(vec![], None).max_queue_size(), 1024);
    }
}
