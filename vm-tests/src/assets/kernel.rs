//! Guest kernels: Debian cloud kernels of several suites, fetched with the lab's private
//! apt, extracted (never installed) and cached per release with the virtio/vsock modules
//! the guest needs (decompressed) and their insmod order.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, ensure, Context, Result};
use serde::{Serialize, Serializer};

use super::apt::{deb_extract, deb_field, depends_names, Apt};
use super::{lock_file, version_key};

/// Modules the guest wants; each pulls its dependencies (`depends=` in `.modinfo`). A
/// wanted module without a `.ko` is built into that kernel (6.12+: virtio_pci, virtio_console).
pub const WANTED_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "vmw_vsock_virtio_transport",
];

/// Which guest kernel the lab boots.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GuestKernel {
    /// Debian 11 bullseye: 5.10.
    V5_10,
    /// Debian 12 bookworm: 6.1 (the default).
    #[default]
    V6_1,
    /// Debian 13 trixie: 6.12.
    V6_12,
    /// Debian sid: the newest 7.x.
    V7,
    /// An explicit `linux-image-*` package name.
    Package(String),
}

impl GuestKernel {
    /// The series that have a short name, for matrices.
    pub const SERIES: [GuestKernel; 4] = [
        GuestKernel::V5_10,
        GuestKernel::V6_1,
        GuestKernel::V6_12,
        GuestKernel::V7,
    ];

    /// Does the kernel release `rel` (e.g. `6.12.107+deb13-cloud-amd64`) belong to this choice?
    pub fn matches_release(&self, rel: &str) -> bool {
        let Some(base) = rel.strip_suffix("-cloud-amd64") else {
            return false;
        };
        match self {
            // 5.10.0-32, 6.1.0-56
            GuestKernel::V5_10 | GuestKernel::V6_1 => {
                let prefix = if *self == GuestKernel::V5_10 {
                    "5.10.0-"
                } else {
                    "6.1.0-"
                };
                base.strip_prefix(prefix)
                    .is_some_and(|abi| !abi.is_empty() && abi.bytes().all(|b| b.is_ascii_digit()))
            }
            // 6.12.107+deb13
            GuestKernel::V6_12 => base
                .strip_suffix("+deb13")
                .and_then(|v| v.strip_prefix("6.12."))
                .is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())),
            // 7.2.13+deb14
            GuestKernel::V7 => {
                let v = base.split_once('+').map_or(base, |(v, _)| v);
                let parts: Vec<&str> = v.split('.').collect();
                parts.len() == 3
                    && parts[0] == "7"
                    && parts
                        .iter()
                        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            }
            GuestKernel::Package(p) => p.strip_prefix("linux-image-") == Some(rel),
        }
    }
}

impl fmt::Display for GuestKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GuestKernel::V5_10 => "5.10",
            GuestKernel::V6_1 => "6.1",
            GuestKernel::V6_12 => "6.12",
            GuestKernel::V7 => "7.x",
            GuestKernel::Package(p) => p,
        })
    }
}

impl FromStr for GuestKernel {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "5.10" | "bullseye" => GuestKernel::V5_10,
            "6.1" | "bookworm" => GuestKernel::V6_1,
            "6.12" | "trixie" => GuestKernel::V6_12,
            "7.x" | "7" | "sid" => GuestKernel::V7,
            p if p.starts_with("linux-image-") && p.len() > "linux-image-".len() => {
                GuestKernel::Package(p.to_string())
            }
            _ => bail!(
                "unknown guest kernel {s:?}: use 5.10, 6.1, 6.12, 7.x or a Debian package name \
                 linux-image-<release>"
            ),
        })
    }
}

impl Serialize for GuestKernel {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A cached guest kernel.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub release: String,
    pub dir: PathBuf,
    pub vmlinuz: PathBuf,
    /// Module names in insmod order (files `modules/<name>.ko`).
    pub modules: Vec<String>,
}

/// The guest kernel `choice`, downloaded and prepared once. A cached release of the series
/// is used without any network access; `VIOTRACE_GUEST_KERNEL_PKG` overrides the default.
pub fn ensure_kernel(cache: &Path, choice: &GuestKernel) -> Result<Kernel> {
    let choice = match std::env::var("VIOTRACE_GUEST_KERNEL_PKG") {
        Ok(p) if *choice == GuestKernel::default() => p.parse()?,
        _ => choice.clone(),
    };
    if let Some((rel, dir)) = newest_cached(cache, &choice)? {
        return load_cached(rel, dir);
    }
    let _lock = lock_file(&cache.join("kernel.lock"))?;
    // Another process may have built it while we waited.
    if let Some((rel, dir)) = newest_cached(cache, &choice)? {
        return load_cached(rel, dir);
    }
    let apt = Apt::new(cache)?;
    let pkg = match &choice {
        GuestKernel::Package(p) => p.clone(),
        c => newest_package(&apt, c)?,
    };
    let release = pkg["linux-image-".len()..].to_string();
    download_kernel(cache, &apt, &pkg, &release)
}

fn load_cached(release: String, dir: PathBuf) -> Result<Kernel> {
    let order = dir.join("modules/order");
    if !order.exists() {
        // Cached by an older lab: the modules are there, derive their order.
        let names = module_order(&dir.join("modules"))?;
        write_atomic(&order, names.join("\n").as_bytes())?;
    }
    let modules = fs::read_to_string(&order)?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    Ok(Kernel {
        vmlinuz: dir.join("vmlinuz"),
        release,
        dir,
        modules,
    })
}

fn write_atomic(p: &Path, data: &[u8]) -> Result<()> {
    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, data)?;
    fs::rename(&tmp, p)?;
    Ok(())
}

fn newest_cached(cache: &Path, choice: &GuestKernel) -> Result<Option<(String, PathBuf)>> {
    let mut best: Option<(Vec<u64>, String, PathBuf)> = None;
    for e in fs::read_dir(cache)?.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rel) = name.strip_prefix("kernel-") else {
            continue;
        };
        if !choice.matches_release(rel) || !e.path().join("ok").exists() {
            continue;
        }
        let key = version_key(rel);
        if best.as_ref().is_none_or(|b| key > b.0) {
            best = Some((key, rel.to_string(), e.path()));
        }
    }
    Ok(best.map(|(_, r, p)| (r, p)))
}

fn newest_package(apt: &Apt, choice: &GuestKernel) -> Result<String> {
    let names = apt.search_names(r"^linux-image-.*-cloud-amd64$")?;
    names
        .into_iter()
        .filter(|n| choice.matches_release(&n["linux-image-".len()..]))
        .max_by_key(|n| version_key(n))
        .with_context(|| format!("no Debian cloud kernel package for guest kernel {choice}"))
}

fn download_kernel(cache: &Path, apt: &Apt, pkg: &str, release: &str) -> Result<Kernel> {
    eprintln!("viotrace-vm: downloading guest kernel {pkg} (once)");
    let work = tempfile::Builder::new()
        .prefix("kernel-download-")
        .tempdir_in(cache)?;
    let dl = work.path().join("debs");
    let mut debs = apt.download(&[pkg.to_string()], &dl)?;
    // 7.x: linux-image-* is a meta package; the image and modules are split out.
    let split: Vec<String> = depends_names(&deb_field(&debs[0], "Depends")?)
        .into_iter()
        .filter(|d| {
            d == &format!("linux-binary-{release}") || d == &format!("linux-modules-{release}")
        })
        .collect();
    if !split.is_empty() {
        debs = apt.download(&split, &dl.join("split"))?;
    } else {
        debs.truncate(1);
    }
    let x = work.path().join("x");
    for d in &debs {
        deb_extract(d, &x)?;
    }
    let stage = work.path().join("kernel");
    fs::create_dir_all(stage.join("modules"))?;
    let vmlinuz = [
        format!("boot/vmlinuz-{release}"),
        format!("usr/lib/modules/{release}/vmlinuz"),
        format!("lib/modules/{release}/vmlinuz"),
    ]
    .iter()
    .map(|p| x.join(p))
    .find(|p| p.is_file())
    .with_context(|| format!("{pkg} (and its split packages) has no vmlinuz"))?;
    fs::copy(&vmlinuz, stage.join("vmlinuz"))?;
    let _ = fs::copy(
        x.join(format!("boot/config-{release}")),
        stage.join("config"),
    );
    let moddir = [
        format!("lib/modules/{release}"),
        format!("usr/lib/modules/{release}"),
    ]
    .iter()
    .map(|p| x.join(p))
    .find(|p| p.join("kernel").is_dir())
    .with_context(|| format!("{pkg} has no modules directory"))?;
    let builtin = collect_modules(&moddir, &stage.join("modules"))?;
    let order = module_order(&stage.join("modules"))?;
    fs::write(stage.join("modules/order"), order.join("\n"))?;
    fs::write(stage.join("builtin"), builtin.join("\n"))?;
    fs::write(stage.join("ok"), pkg)?;
    let dir = cache.join(format!("kernel-{release}"));
    let _ = fs::remove_dir_all(&dir);
    fs::rename(&stage, &dir)?;
    load_cached(release.to_string(), dir)
}

/// Index of a kernel's module files by module name (`-` and `_` are the same).
fn index_modules(dir: &Path, idx: &mut BTreeMap<String, PathBuf>) -> Result<()> {
    for e in fs::read_dir(dir)?.filter_map(|e| e.ok()) {
        let p = e.path();
        if e.file_type()?.is_dir() {
            index_modules(&p, idx)?;
            continue;
        }
        let f = e.file_name().to_string_lossy().into_owned();
        let stem = [".ko", ".ko.xz"].iter().find_map(|ext| f.strip_suffix(ext));
        if let Some(stem) = stem {
            idx.insert(stem.replace('-', "_"), p);
        }
    }
    Ok(())
}

/// Copies the wanted modules and their dependencies (decompressed) into `out`; returns
/// the wanted modules that have no file (built into this kernel).
fn collect_modules(moddir: &Path, out: &Path) -> Result<Vec<String>> {
    let mut idx = BTreeMap::new();
    index_modules(&moddir.join("kernel"), &mut idx)?;
    let listed_builtin = fs::read_to_string(moddir.join("modules.builtin")).ok();
    let mut builtin = Vec::new();
    let mut todo: Vec<String> = Vec::new();
    for m in WANTED_MODULES {
        if idx.contains_key(*m) {
            todo.push(m.to_string());
            continue;
        }
        if let Some(list) = &listed_builtin {
            ensure!(
                list.lines()
                    .any(|l| l.rsplit('/').next() == Some(&format!("{m}.ko"))),
                "module {m} is neither a file nor listed in modules.builtin in {}",
                moddir.display()
            );
        }
        builtin.push(m.to_string());
    }
    let mut done = BTreeSet::new();
    while let Some(m) = todo.pop() {
        if !done.insert(m.clone()) {
            continue;
        }
        let src = idx.get(&m).with_context(|| {
            format!(
                "module {m} (a dependency) not found in {}",
                moddir.display()
            )
        })?;
        let data = read_module(src)?;
        for d in modinfo_depends(&data)? {
            todo.push(d);
        }
        fs::write(out.join(format!("{m}.ko")), data)?;
    }
    Ok(builtin)
}

/// A module file's bytes, decompressed if it is `.ko.xz`.
pub fn read_module(p: &Path) -> Result<Vec<u8>> {
    let raw = fs::read(p).with_context(|| format!("read {}", p.display()))?;
    if p.extension().is_some_and(|e| e == "xz") {
        let mut out = Vec::new();
        lzma_rs::xz_decompress(&mut &raw[..], &mut out)
            .map_err(|e| anyhow::anyhow!("decompress {}: {e:?}", p.display()))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// The `.modinfo` `key=value` strings of a module.
fn modinfo(data: &[u8]) -> Result<Vec<(String, String)>> {
    use object::{Object, ObjectSection};
    let f = object::File::parse(data).context("parse kernel module (ELF)")?;
    let sec = f
        .section_by_name(".modinfo")
        .context("kernel module without .modinfo")?;
    let bytes = sec.data().context("read .modinfo")?;
    Ok(bytes
        .split(|b| *b == 0)
        .filter_map(|kv| {
            let s = String::from_utf8_lossy(kv);
            s.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect())
}

/// Module names this module depends on.
fn modinfo_depends(data: &[u8]) -> Result<Vec<String>> {
    Ok(modinfo(data)?
        .into_iter()
        .filter(|(k, _)| k == "depends")
        .flat_map(|(_, v)| {
            v.split(',')
                .filter(|d| !d.is_empty())
                .map(|d| d.replace('-', "_"))
                .collect::<Vec<_>>()
        })
        .collect())
}

/// Insmod order of the modules in `dir` (`<name>.ko`): dependencies first, ties by name.
pub fn module_order(dir: &Path) -> Result<Vec<String>> {
    let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in fs::read_dir(dir)?.filter_map(|e| e.ok()) {
        let f = e.file_name().to_string_lossy().into_owned();
        if let Some(m) = f.strip_suffix(".ko") {
            deps.insert(m.to_string(), modinfo_depends(&fs::read(e.path())?)?);
        }
    }
    topo_order(&deps)
}

fn topo_order(deps: &BTreeMap<String, Vec<String>>) -> Result<Vec<String>> {
    let mut order = Vec::new();
    let mut placed = BTreeSet::new();
    while placed.len() < deps.len() {
        let next = deps
            .iter()
            .find(|(m, ds)| !placed.contains(*m) && ds.iter().all(|d| placed.contains(d)));
        match next {
            Some((m, _)) => {
                placed.insert(m.clone());
                order.push(m.clone());
            }
            None => {
                let stuck: Vec<_> = deps
                    .iter()
                    .filter(|(m, _)| !placed.contains(*m))
                    .map(|(m, ds)| format!("{m} needs {ds:?}"))
                    .collect();
                bail!(
                    "module dependencies cannot be ordered: {}",
                    stuck.join("; ")
                );
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_match_their_releases_only() {
        use GuestKernel::*;
        assert!(V5_10.matches_release("5.10.0-32-cloud-amd64"));
        assert!(!V5_10.matches_release("5.10.0-32-amd64"));
        assert!(V6_1.matches_release("6.1.0-56-cloud-amd64"));
        assert!(!V6_1.matches_release("6.12.107+deb13-cloud-amd64"));
        assert!(V6_12.matches_release("6.12.107+deb13-cloud-amd64"));
        assert!(!V6_12.matches_release("6.12.95+deb12-cloud-amd64"));
        assert!(V7.matches_release("7.2.13+deb14-cloud-amd64"));
        assert!(!V7.matches_release("6.1.0-56-cloud-amd64"));
        let p: GuestKernel = "linux-image-6.12.95+deb12-cloud-amd64".parse().unwrap();
        assert!(p.matches_release("6.12.95+deb12-cloud-amd64"));
        assert!(!p.matches_release("6.12.107+deb13-cloud-amd64"));
        assert!("6.13".parse::<GuestKernel>().is_err());
        assert_eq!("sid".parse::<GuestKernel>().unwrap().to_string(), "7.x");
    }

    #[test]
    fn dependencies_come_first() {
        let deps: BTreeMap<String, Vec<String>> = [
            (
                "virtio_pci",
                vec!["virtio_ring", "virtio", "virtio_pci_modern_dev"],
            ),
            ("virtio_blk", vec!["virtio", "virtio_ring"]),
            ("virtio_ring", vec![]),
            ("virtio", vec![]),
            ("virtio_pci_modern_dev", vec![]),
        ]
        .into_iter()
        .map(|(m, d)| (m.to_string(), d.into_iter().map(String::from).collect()))
        .collect();
        let o = topo_order(&deps).unwrap();
        let pos = |m: &str| o.iter().position(|x| x == m).unwrap();
        assert!(pos("virtio") < pos("virtio_pci") && pos("virtio_ring") < pos("virtio_blk"));
        assert!(pos("virtio_pci_modern_dev") < pos("virtio_pci"));
        let cyc: BTreeMap<String, Vec<String>> = [
            ("a".to_string(), vec!["b".to_string()]),
            ("b".to_string(), vec!["a".to_string()]),
        ]
        .into_iter()
        .collect();
        assert!(topo_order(&cyc).is_err());
    }
}
