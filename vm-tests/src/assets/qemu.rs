//! QEMU builds for the lab: the host's own (Debian 12's 7.2), bookworm-backports' 10.0
//! (extracted from its packages, runs on the host's libraries) and sid's 11.x, which needs
//! newer libraries than the host has and so runs inside a minimal Debian sid root made with
//! debootstrap — the "containerised QEMU" case: in a private mount namespace, pivoted
//! into that root, its binary path exists only under `/proc/PID/root`.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

use anyhow::{bail, ensure, Context, Result};
use serde::{Serialize, Serializer};

use super::apt::{deb_extract, Apt};
use super::{lock_file, need_tool, run};

/// The Debian mirror debootstrap uses.
const DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";
const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// Which QEMU the lab runs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QemuBuild {
    /// The host's `qemu-system-x86_64` (Debian 12: 7.2).
    #[default]
    V7_2,
    /// bookworm-backports' 10.0, extracted into the cache.
    V10_0,
    /// sid's 11.x, run inside a debootstrapped sid root (mount namespace + pivot_root).
    V11,
    /// A given `qemu-system-x86_64` binary.
    Path(PathBuf),
}

impl QemuBuild {
    pub const BUILDS: [QemuBuild; 3] = [QemuBuild::V7_2, QemuBuild::V10_0, QemuBuild::V11];
}

impl fmt::Display for QemuBuild {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QemuBuild::V7_2 => f.write_str("7.2"),
            QemuBuild::V10_0 => f.write_str("10.0"),
            QemuBuild::V11 => f.write_str("11.x"),
            QemuBuild::Path(p) => write!(f, "{}", p.display()),
        }
    }
}

impl FromStr for QemuBuild {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "7.2" | "system" | "host" => QemuBuild::V7_2,
            "10.0" | "10" | "bookworm-backports" => QemuBuild::V10_0,
            "11.x" | "11" | "sid" => QemuBuild::V11,
            p if p.contains('/') => QemuBuild::Path(PathBuf::from(p)),
            _ => bail!("unknown QEMU {s:?}: use 7.2, 10.0, 11.x or a path to a qemu-system-x86_64"),
        })
    }
}

impl Serialize for QemuBuild {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A prepared QEMU.
#[derive(Clone, Debug)]
pub struct Qemu {
    pub build: QemuBuild,
    /// The binary; for a rooted build, its path inside `root`.
    pub binary: PathBuf,
    /// The root QEMU runs in (private mount namespace + pivot_root), if not the host's.
    pub root: Option<PathBuf>,
    /// Firmware directories (`-L`), searched before the build's defaults.
    pub data_dirs: Vec<PathBuf>,
    /// QEMU's loadable modules directory (`QEMU_MODULE_DIR`), for extracted builds.
    pub module_dir: Option<PathBuf>,
    /// `x.y.z` from `--version`.
    pub version: String,
}

/// The container-like wrapper, run in a private mount namespace: makes the root a mount,
/// mounts /proc, /dev, /sys and a private /tmp in it, binds the given host directories at
/// the same paths, pivots into it (so the host sees the binary as `/usr/bin/…` of a
/// foreign root, as with container runtimes) and execs QEMU (same pid).
const ROOTED_EXEC: &str = r#"set -e
root=$1; bin=$2; shift 2
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -t tmpfs tmpfs "$root/tmp"
while [ "$1" != -- ]; do
	mkdir -p "$root$1"
	mount --bind "$1" "$root$1"
	shift
done
shift
mkdir "$root/tmp/.oldroot"
cd "$root"
pivot_root . tmp/.oldroot
umount -l /tmp/.oldroot
rmdir /tmp/.oldroot
exec "$bin" "$@"
"#;

impl Qemu {
    /// The QEMU `Command`; `binds` are host directories QEMU must reach at the same path
    /// (the run directory with the kernel, initrd, disks and sockets).
    pub fn command(&self, binds: &[&Path]) -> Command {
        let mut c = match &self.root {
            None => Command::new(&self.binary),
            Some(root) => {
                let mut c = Command::new("unshare");
                c.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
                    .arg(ROOTED_EXEC)
                    .arg("sh")
                    .arg(root)
                    .arg(&self.binary)
                    .args(binds)
                    .arg("--");
                c
            }
        };
        for d in &self.data_dirs {
            c.arg("-L").arg(d);
        }
        if let Some(m) = &self.module_dir {
            c.env("QEMU_MODULE_DIR", m);
        }
        c
    }

    /// Whether QEMU only sees its own root (files must be bound in).
    pub fn rooted(&self) -> bool {
        self.root.is_some()
    }
}

/// Prepares (downloads, extracts, debootstraps; once) the QEMU `build`.
pub fn ensure_qemu(cache: &Path, build: &QemuBuild) -> Result<Qemu> {
    let mut q = match build {
        QemuBuild::V7_2 => Qemu {
            build: build.clone(),
            binary: super::which("qemu-system-x86_64").context(
                "`qemu-system-x86_64` not found: install the Debian package `qemu-system-x86` \
                 (scripts/setup.sh does this)",
            )?,
            root: None,
            data_dirs: Vec::new(),
            module_dir: None,
            version: String::new(),
        },
        QemuBuild::Path(p) => {
            ensure!(p.is_file(), "QEMU binary {} does not exist", p.display());
            Qemu {
                build: build.clone(),
                binary: p.clone(),
                root: None,
                data_dirs: Vec::new(),
                module_dir: None,
                version: String::new(),
            }
        }
        QemuBuild::V10_0 => ensure_backports(cache)?,
        QemuBuild::V11 => ensure_sid_root(cache)?,
    };
    q.version = qemu_version(&q)?;
    Ok(q)
}

fn qemu_version(q: &Qemu) -> Result<String> {
    let mut c = match &q.root {
        None => Command::new(&q.binary),
        Some(root) => {
            let mut c = Command::new("chroot");
            c.arg(root).arg(&q.binary);
            c
        }
    };
    if let Some(m) = &q.module_dir {
        c.env("QEMU_MODULE_DIR", m);
    }
    let out = run(c.arg("--version")).with_context(|| format!("QEMU {} does not run", q.build))?;
    parse_version(&out).with_context(|| format!("no version in `{}`", out.trim()))
}

/// `QEMU emulator version 10.0.2 (Debian …)` → `10.0.2`.
fn parse_version(out: &str) -> Option<String> {
    let rest = out.split("version ").nth(1)?;
    let v: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    (!v.is_empty()).then_some(v)
}

/// bookworm-backports' QEMU 10.0, extracted into `<cache>/qemu-10.0-bookworm-backports`.
fn ensure_backports(cache: &Path) -> Result<Qemu> {
    let dir = cache.join("qemu-10.0-bookworm-backports");
    if !dir.join("ok").exists() {
        let _lock = lock_file(&cache.join("qemu.lock"))?;
        if !dir.join("ok").exists() {
            eprintln!("viotrace-vm: downloading QEMU 10.0 from bookworm-backports (once)");
            let apt = Apt::new(cache)?;
            let work = tempfile::Builder::new()
                .prefix("qemu-download-")
                .tempdir_in(cache)?;
            let pkgs: Vec<String> = [
                "qemu-system-x86",
                "qemu-system-common",
                "qemu-system-data",
                "seabios",
            ]
            .iter()
            .map(|p| format!("{p}/bookworm-backports"))
            .collect();
            let stage = work.path().join("x");
            for deb in apt.download(&pkgs, &work.path().join("debs"))? {
                deb_extract(&deb, &stage)?;
            }
            ensure!(
                stage.join("usr/bin/qemu-system-x86_64").is_file(),
                "the bookworm-backports packages have no usr/bin/qemu-system-x86_64"
            );
            fs::write(stage.join("ok"), pkgs.join("\n"))?;
            let _ = fs::remove_dir_all(&dir);
            fs::rename(&stage, &dir)?;
        }
    }
    Ok(Qemu {
        build: QemuBuild::V10_0,
        binary: dir.join("usr/bin/qemu-system-x86_64"),
        root: None,
        data_dirs: vec![dir.join("usr/share/qemu"), dir.join("usr/share/seabios")],
        module_dir: Some(dir.join("usr/lib/x86_64-linux-gnu/qemu")),
        version: String::new(),
    })
}

/// The debootstrapped sid root with QEMU installed: `<cache>/qemu-root-sid`. Built in a
/// temporary directory (inside a private mount namespace, so nothing debootstrap mounts
/// leaks) and renamed into place when complete.
fn ensure_sid_root(cache: &Path) -> Result<Qemu> {
    let dir = cache.join("qemu-root-sid");
    if !dir.join("viotrace-ok").exists() {
        let _lock = lock_file(&cache.join("qemu.lock"))?;
        if !dir.join("viotrace-ok").exists() {
            build_sid_root(cache, &dir)?;
        }
    }
    Ok(Qemu {
        build: QemuBuild::V11,
        binary: PathBuf::from("/usr/bin/qemu-system-x86_64"),
        root: Some(dir),
        data_dirs: Vec::new(),
        module_dir: None,
        version: String::new(),
    })
}

fn build_sid_root(cache: &Path, dir: &Path) -> Result<()> {
    need_tool("debootstrap", "debootstrap")?;
    need_tool("unshare", "util-linux")?;
    eprintln!(
        "viotrace-vm: building a Debian sid root with QEMU 11.x (debootstrap, once, a few minutes)"
    );
    let tmp = cache.join("qemu-root-sid.tmp");
    // A previous attempt died half-way: its mounts died with its namespace.
    if tmp.exists() {
        fs::remove_dir_all(&tmp).with_context(|| format!("remove stale {}", tmp.display()))?;
    }
    let log = cache.join("qemu-root-sid.log");
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", "--", "debootstrap"])
        .args(["--variant=minbase", "--include=qemu-system-x86"]);
    if Path::new(KEYRING).exists() {
        c.arg(format!("--keyring={KEYRING}"));
    }
    c.arg("sid").arg(&tmp).arg(DEBIAN_MIRROR);
    let st = c
        .stdout(fs::File::create(&log)?)
        .stderr(fs::File::create(log.with_extension("err"))?)
        .status()
        .context("run debootstrap")?;
    if !st.success() {
        bail!(
            "debootstrap of sid failed ({st}); see {} and {}",
            log.display(),
            log.with_extension("err").display()
        );
    }
    ensure!(
        tmp.join("usr/bin/qemu-system-x86_64").is_file(),
        "the sid root has no /usr/bin/qemu-system-x86_64 after debootstrap"
    );
    // Downloaded packages are not needed any more.
    let archives = tmp.join("var/cache/apt/archives");
    for e in fs::read_dir(&archives).into_iter().flatten().flatten() {
        if e.path().extension().is_some_and(|x| x == "deb") {
            let _ = fs::remove_file(e.path());
        }
    }
    fs::write(
        tmp.join("viotrace-ok"),
        b"debootstrap sid + qemu-system-x86\n",
    )?;
    let _ = fs::remove_dir_all(dir);
    fs::rename(&tmp, dir)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_builds_and_versions() {
        assert_eq!("7.2".parse::<QemuBuild>().unwrap(), QemuBuild::V7_2);
        assert_eq!("10.0".parse::<QemuBuild>().unwrap(), QemuBuild::V10_0);
        assert_eq!("sid".parse::<QemuBuild>().unwrap().to_string(), "11.x");
        assert_eq!(
            "/opt/q/qemu-system-x86_64".parse::<QemuBuild>().unwrap(),
            QemuBuild::Path("/opt/q/qemu-system-x86_64".into())
        );
        assert!("9.2".parse::<QemuBuild>().is_err());
        assert_eq!(
            parse_version("QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2)\nCopyright")
                .as_deref(),
            Some("10.0.2")
        );
        assert_eq!(parse_version("nothing"), None);
    }

    #[test]
    fn rooted_command_binds_then_pivots() {
        let q = Qemu {
            build: QemuBuild::V11,
            binary: "/usr/bin/qemu-system-x86_64".into(),
            root: Some("/cache/root".into()),
            data_dirs: Vec::new(),
            module_dir: None,
            version: "11.1.3".into(),
        };
        let mut c = q.command(&[Path::new("/tmp/run")]);
        c.arg("-name").arg("x");
        let args: Vec<String> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(c.get_program(), "unshare");
        assert_eq!(
            args[args.len() - 7..],
            [
                "sh",
                "/cache/root",
                "/usr/bin/qemu-system-x86_64",
                "/tmp/run",
                "--",
                "-name",
                "x"
            ]
        );
    }
}
