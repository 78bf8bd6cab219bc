//! Lab assets, built once and cached: the guest kernel and its modules, the base
//! initramfs (busybox, fio and its libraries, the virtio modules), the golden ext4
//! data disk, the vhost-user vsock backend and the agent binaries.
//!
//! Everything lives under the cache directory (default `<workspace>/target/vm-cache`,
//! override with `VIOTRACE_CACHE`), in sub-directories keyed by versions, so a second
//! run downloads nothing.

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use nix::fcntl::{Flock, FlockArg};

pub mod apt;
pub mod kernel;
pub mod prometheus;
pub mod qemu;

pub use kernel::{GuestKernel, Kernel};
pub use qemu::{Qemu, QemuBuild};

/// Size of the golden data disk.
pub const DATA_DISK_MIB: u64 = 256;

/// The vhost-user vsock backend we install (crates.io).
pub const VHOST_VSOCK_CRATE: &str = "vhost-device-vsock";
pub const VHOST_VSOCK_VERSION: &str = "0.3.0";

/// Bump when the layout of the base initramfs changes.
const INITRAMFS_LAYOUT: u32 = 2;

/// The guest init script (embedded).
pub const GUEST_INIT: &str = include_str!("../../guest/init.sh");

/// Paths of the cached assets shared by every guest kernel.
#[derive(Debug, Clone)]
pub struct Assets {
    pub cache: PathBuf,
    pub golden_raw: PathBuf,
    pub golden_qcow2: PathBuf,
    pub vhost_vsock: Option<PathBuf>,
}

/// The workspace root (the lab runs from a source checkout).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The cache directory.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("VIOTRACE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target").join("vm-cache"))
}

pub(crate) fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) fn need_tool(tool: &str, package: &str) -> Result<()> {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    ensure!(
        found,
        "`{tool}` not found: install the Debian package `{package}` (scripts/setup.sh does this)"
    );
    Ok(())
}

impl Assets {
    /// Builds whatever is missing (except guest kernels, see [`GuestAssets::ensure`]) and
    /// returns the paths. Idempotent and cheap when cached.
    pub fn ensure() -> Result<Assets> {
        let cache = cache_dir();
        fs::create_dir_all(&cache).with_context(|| format!("create {}", cache.display()))?;
        let (golden_raw, golden_qcow2) = ensure_golden_disk(&cache)?;
        let vhost_vsock = find_vhost_vsock(&cache);
        Ok(Assets {
            cache,
            golden_raw,
            golden_qcow2,
            vhost_vsock,
        })
    }
}

/// One guest kernel and the base initramfs built for it.
#[derive(Debug, Clone)]
pub struct GuestAssets {
    pub kernel: Kernel,
    pub base_initramfs: PathBuf,
}

impl GuestAssets {
    /// The guest kernel `choice` (downloaded once) and its initramfs (built once).
    pub fn ensure(cache: &Path, choice: &GuestKernel) -> Result<GuestAssets> {
        let kernel = kernel::ensure_kernel(cache, choice)?;
        let base_initramfs = ensure_base_initramfs(cache, &kernel)?;
        Ok(GuestAssets {
            kernel,
            base_initramfs,
        })
    }
}

/// An exclusive `flock` on `path` (created if missing), held until the guard drops.
pub fn lock_file(path: &Path) -> Result<Flock<File>> {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("open lock file {}", path.display()))?;
    Flock::lock(f, FlockArg::LockExclusive)
        .map_err(|(_, e)| anyhow::anyhow!("lock {}: {e}", path.display()))
}

pub(crate) fn version_key(s: &str) -> Vec<u64> {
    s.split(|c: char| !c.is_ascii_digit())
        .filter(|x| !x.is_empty())
        .filter_map(|x| x.parse().ok())
        .collect()
}

/// A cpio (newc) archive writer: directories, files, symlinks, all owned by root.
pub struct Cpio<W: Write> {
    out: Option<W>,
    ino: u32,
    dirs: BTreeSet<String>,
}

impl<W: Write> Cpio<W> {
    pub fn new(out: W, first_ino: u32) -> Self {
        Cpio {
            out: Some(out),
            ino: first_ino,
            dirs: BTreeSet::new(),
        }
    }

    fn entry(&mut self, name: &str, mode: u32, nlink: u32, data: &[u8]) -> Result<()> {
        self.ino += 1;
        let out = self.out.take().context("cpio writer already finished")?;
        let len = u32::try_from(data.len()).context("file too large for cpio")?;
        let mut w = cpio::newc::Builder::new(name)
            .ino(self.ino)
            .mode(mode)
            .uid(0)
            .gid(0)
            .nlink(nlink)
            .write(out, len);
        w.write_all(data)?;
        self.out = Some(w.finish()?);
        Ok(())
    }

    /// Adds a directory and its parents (once).
    pub fn dir(&mut self, path: &str) -> Result<()> {
        let path = path.trim_matches('/');
        if path.is_empty() || self.dirs.contains(path) {
            return Ok(());
        }
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent)?;
        }
        self.dirs.insert(path.to_string());
        self.entry(path, 0o040755, 2, &[])
    }

    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> Result<()> {
        let path = path.trim_matches('/');
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent)?;
        }
        self.entry(path, 0o100000 | (mode & 0o7777), 1, data)
    }

    pub fn host_file(&mut self, path: &str, src: &Path) -> Result<()> {
        let data = fs::read(src).with_context(|| format!("read {}", src.display()))?;
        let mode = fs::metadata(src)?.permissions().mode();
        self.file(path, mode, &data)
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> Result<()> {
        let path = path.trim_matches('/');
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent)?;
        }
        self.entry(path, 0o120777, 1, target.as_bytes())
    }

    pub fn finish(mut self) -> Result<W> {
        let out = self.out.take().context("cpio writer already finished")?;
        Ok(cpio::newc::trailer(out)?)
    }
}

/// Shared libraries a dynamically linked program needs (ldd closure), as (path in guest, host path).
fn library_closure(bin: &Path) -> Result<Vec<(String, PathBuf)>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("cannot run ldd")?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    // A static program (e.g. the guest agent built with `--profile guest`)
    // needs nothing beside it.
    if stdout.contains("statically linked") || stderr.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    ensure!(
        out.status.success(),
        "ldd {} failed ({}): {}",
        bin.display(),
        out.status,
        stderr.trim()
    );
    let out = stdout;
    let mut libs = Vec::new();
    for line in out.lines() {
        // "libx.so.1 => /lib/x86_64-linux-gnu/libx.so.1 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rhs)) => rhs.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            let canon = fs::canonicalize(p).with_context(|| format!("resolve {p}"))?;
            libs.push((p.to_string(), canon));
        }
    }
    ensure!(
        !libs.is_empty(),
        "ldd found no libraries for {}",
        bin.display()
    );
    Ok(libs)
}

pub(crate) fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
    })
}

/// The base initramfs: busybox, fio + libraries, the kernel's modules (and their insmod
/// order in `lib/modules/order`) and the init script.
fn ensure_base_initramfs(cache: &Path, kernel: &Kernel) -> Result<PathBuf> {
    let release = &kernel.release;
    need_tool("busybox", "busybox-static")?;
    need_tool("fio", "fio")?;
    let busybox = which("busybox").context("busybox")?;
    let fio = fs::canonicalize(which("fio").context("fio")?)?;
    let fio_version = run(Command::new(&fio).arg("--version"))?.trim().to_string();
    let init_hash = fnv1a(GUEST_INIT.as_bytes());
    let path = cache.join(format!(
        "initramfs-{release}-{fio_version}-l{INITRAMFS_LAYOUT}-{init_hash:016x}.cpio"
    ));
    if path.exists() {
        return Ok(path);
    }
    let bb = fs::read(&busybox)?;
    ensure!(
        !bb.windows(16).any(|w| w == b"/lib64/ld-linux-"),
        "{} is dynamically linked: install busybox-static",
        busybox.display()
    );
    eprintln!("viotrace-vm: building the guest initramfs (once)");
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let f = BufWriter::new(File::create(&tmp)?);
    let mut c = Cpio::new(f, 0);
    for d in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "proc",
        "sys",
        "dev",
        "run",
        "tmp",
        "out",
        "data",
        "etc",
        "root",
        "lib/modules",
    ] {
        c.dir(d)?;
    }
    c.file("bin/busybox", 0o755, &bb)?;
    c.symlink("bin/sh", "busybox")?;
    c.file("init", 0o755, GUEST_INIT.as_bytes())?;
    c.file("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\n")?;
    c.file("etc/group", 0o644, b"root:x:0:\n")?;
    for m in &kernel.modules {
        c.host_file(
            &format!("lib/modules/{m}.ko"),
            &kernel.dir.join("modules").join(format!("{m}.ko")),
        )?;
    }
    let mut order = kernel.modules.join("\n");
    order.push('\n');
    c.file("lib/modules/order", 0o644, order.as_bytes())?;
    c.host_file("usr/bin/fio", &fio)?;
    for (guest_path, host_path) in library_closure(&fio)? {
        c.host_file(&guest_path, &host_path)?;
    }
    c.finish()?.flush()?;
    fs::rename(&tmp, &path)?;
    Ok(path)
}

/// An initramfs overlay holding host programs (and their shared libraries) for the guest,
/// e.g. `bpftrace` for the bench's anchor. Cached by the programs' identities.
pub fn tools_overlay(cache: &Path, tools: &[String]) -> Result<PathBuf> {
    let mut key = String::new();
    let mut bins = Vec::new();
    for t in tools {
        // A path (with a `/`) names the program itself, else it is looked up in PATH.
        let found = match t.contains('/') {
            true => Some(PathBuf::from(t)).filter(|p| p.is_file()),
            false => which(t),
        };
        let bin = fs::canonicalize(found.with_context(|| {
            format!("`{t}` is not installed on this host (it is copied into the guest)")
        })?)?;
        let md = fs::metadata(&bin)?;
        // In the guest under its own name: `perf` and `/usr/bin/perf` are both /usr/bin/perf.
        let name = Path::new(t)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .with_context(|| format!("guest tool `{t}` has no file name"))?;
        key += &format!(
            "{name}={}:{}:{:?};",
            bin.display(),
            md.len(),
            md.modified().ok()
        );
        bins.push((name, bin));
    }
    let path = cache.join(format!("tools-{:016x}.cpio", fnv1a(key.as_bytes())));
    if path.exists() {
        return Ok(path);
    }
    let tmp = path.with_extension("tmp");
    let mut c = Cpio::new(BufWriter::new(File::create(&tmp)?), 2_000_000);
    let mut seen = BTreeSet::new();
    for (name, bin) in &bins {
        c.host_file(&format!("usr/bin/{name}"), bin)?;
        for (guest_path, host_path) in library_closure(bin)? {
            if seen.insert(guest_path.clone()) {
                c.host_file(&guest_path, &host_path)?;
            }
        }
    }
    c.finish()?.flush()?;
    fs::rename(&tmp, &path)?;
    Ok(path)
}

/// FNV-1a, for cache keys.
pub fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Golden ext4 data disk (raw, plus a qcow2 copy). Lazy init is off so the guest
/// does no background I/O on it.
fn ensure_golden_disk(cache: &Path) -> Result<(PathBuf, PathBuf)> {
    let raw = cache.join(format!("golden-ext4-{DATA_DISK_MIB}M.raw"));
    let qcow2 = cache.join(format!("golden-ext4-{DATA_DISK_MIB}M.qcow2"));
    if !raw.exists() {
        need_tool("mkfs.ext4", "e2fsprogs")?;
        let tmp = raw.with_extension("tmp");
        let f = File::create(&tmp)?;
        f.set_len(DATA_DISK_MIB << 20)?;
        drop(f);
        run(Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-L",
                "data",
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0",
            ])
            .arg(&tmp))?;
        fs::rename(&tmp, &raw)?;
    }
    if !qcow2.exists() {
        need_tool("qemu-img", "qemu-utils")?;
        let tmp = qcow2.with_extension("qtmp");
        run(Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .arg(&raw)
            .arg(&tmp))?;
        fs::rename(&tmp, &qcow2)?;
    }
    Ok((raw, qcow2))
}

/// The vhost-user vsock backend: `VIOTRACE_VHOST_VSOCK`, the project-local install, or PATH.
pub fn find_vhost_vsock(cache: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("VIOTRACE_VHOST_VSOCK") {
        return Some(PathBuf::from(p));
    }
    let local = cache.join("tools/bin").join(VHOST_VSOCK_CRATE);
    if local.is_file() {
        return Some(local);
    }
    which(VHOST_VSOCK_CRATE)
}

/// Installs the vhost-user vsock backend into the cache (cargo install, once).
pub fn install_vhost_vsock(cache: &Path) -> Result<PathBuf> {
    if let Some(p) = find_vhost_vsock(cache) {
        return Ok(p);
    }
    eprintln!("viotrace-vm: installing {VHOST_VSOCK_CRATE} {VHOST_VSOCK_VERSION} (once, ~2 min)");
    let root = cache.join("tools");
    run(Command::new(cargo())
        .args([
            "install",
            "--locked",
            VHOST_VSOCK_CRATE,
            "--version",
            VHOST_VSOCK_VERSION,
            "--root",
        ])
        .arg(&root))?;
    find_vhost_vsock(cache).context("vhost-device-vsock not found after install")
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Builds (if needed) the fully static guest agent and returns its path.
/// `VIOTRACE_GUEST_BIN` overrides.
pub fn guest_agent_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("VIOTRACE_GUEST_BIN") {
        return Ok(PathBuf::from(p));
    }
    let root = workspace_root();
    let target = "x86_64-unknown-linux-gnu";
    let status = Command::new(cargo())
        .current_dir(&root)
        .args([
            "build",
            // the release profile, start-up-only dependencies built for size
            // (Cargo.toml: the agent's peak RSS in the guest)
            "--profile",
            "guest",
            "-q",
            "-p",
            "viotrace-guest",
            "--features",
            "static",
            "--target",
            target,
        ])
        .env(
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
            "-C target-feature=+crt-static",
        )
        .env("LIBBPF_SYS_LIBRARY_PATH", "/usr/lib/x86_64-linux-gnu")
        .status()
        .context("run cargo to build the static guest agent")?;
    ensure!(status.success(), "building the static guest agent failed");
    let bin = target_dir().join(target).join("guest/viotrace-guest");
    ensure!(bin.is_file(), "{} missing after build", bin.display());
    Ok(bin)
}

/// Builds (if needed) the host agent and returns its path. `VIOTRACE_HOST_BIN` overrides.
pub fn host_agent_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("VIOTRACE_HOST_BIN") {
        return Ok(PathBuf::from(p));
    }
    let status = Command::new(cargo())
        .current_dir(workspace_root())
        .args(["build", "--release", "-q", "-p", "viotrace-host"])
        .status()
        .context("run cargo to build the host agent")?;
    ensure!(status.success(), "building the host agent failed");
    let bin = target_dir().join("release/viotrace-host");
    ensure!(bin.is_file(), "{} missing after build", bin.display());
    Ok(bin)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// Makes a file executable (for workload scripts given without +x).
pub fn make_executable(p: &Path) -> Result<()> {
    let mut perm = fs::metadata(p)?.permissions();
    perm.set_mode(perm.mode() | 0o755);
    fs::set_permissions(p, perm)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_key_orders_kernel_abis() {
        assert!(
            version_key("linux-image-6.1.0-56-cloud-amd64")
                > version_key("linux-image-6.1.0-9-cloud-amd64")
        );
    }

    /// The `(name, mode)` of every entry of a cpio archive.
    fn cpio_entries(bytes: &[u8]) -> Vec<(String, u32)> {
        let mut names = Vec::new();
        let mut rest = bytes;
        loop {
            let r = cpio::NewcReader::new(rest).unwrap();
            if r.entry().is_trailer() {
                break;
            }
            names.push((r.entry().name().to_string(), r.entry().mode()));
            rest = r.finish().unwrap();
        }
        names
    }

    #[test]
    fn tools_overlay_takes_names_paths_and_static_programs() {
        let cache = tempfile::tempdir().unwrap();
        // `sh` from PATH (dynamic: its libraries come along); ldconfig by
        // path (glibc's is static-pie, as the guest agent built with
        // `--profile guest` is: nothing else comes along).
        let tools = ["sh".to_string(), "/sbin/ldconfig".to_string()];
        let overlay = tools_overlay(cache.path(), &tools).unwrap();
        let names: Vec<String> = cpio_entries(&fs::read(&overlay).unwrap())
            .into_iter()
            .map(|e| e.0)
            .collect();
        assert!(names.iter().any(|n| n == "usr/bin/sh"), "{names:?}");
        assert!(names.iter().any(|n| n == "usr/bin/ldconfig"), "{names:?}");
        assert!(
            names.iter().any(|n| n.contains("libc.so")),
            "sh's libraries: {names:?}"
        );
        let alone = tools_overlay(cache.path(), &tools[1..]).unwrap();
        let files: Vec<String> = cpio_entries(&fs::read(&alone).unwrap())
            .into_iter()
            .filter(|e| e.1 & 0o170000 != 0o040000)
            .map(|e| e.0)
            .collect();
        assert_eq!(files, ["usr/bin/ldconfig"]);
        // A path that names no file is refused, not looked up in PATH.
        let err = tools_overlay(cache.path(), &["./no/such/tool".into()]).unwrap_err();
        assert!(err.to_string().contains("is not installed"), "{err:#}");
    }

    #[test]
    fn cpio_roundtrip() {
        let mut c = Cpio::new(Vec::new(), 0);
        c.file("a/b/c.txt", 0o644, b"hello").unwrap();
        c.symlink("a/l", "b/c.txt").unwrap();
        let bytes = c.finish().unwrap();
        let names = cpio_entries(&bytes);
        assert_eq!(
            names,
            vec![
                ("a".to_string(), 0o040755),
                ("a/b".to_string(), 0o040755),
                ("a/b/c.txt".to_string(), 0o100644),
                ("a/l".to_string(), 0o120777),
            ]
        );
    }
}
