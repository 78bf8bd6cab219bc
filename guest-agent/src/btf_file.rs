//! The kernel's BTF as a file libbpf can map.
//!
//! libbpf maps `/sys/kernel/btf/vmlinux` when the kernel allows it (6.16+).
//! Older kernels refuse, and libbpf then reads the file into a buffer and copies
//! it: two private copies of 4–6 MB at once, each time the BTF is loaded (the
//! agent's start-up facts, then the BPF object), and the agent's peak memory.
//! Here, for start-up only, the agent sees another file at that path: on a
//! private tmpfs, bound over it in its own mount namespace. libbpf maps it, and
//! the BTF is in memory once, as shared pages, freed when the tmpfs goes.
//!
//! That file is the part of the BTF the agent uses ([`crate::btf_min`]): every
//! type at its own id, but only the wanted ones whole: 1.0–1.4 MB instead of
//! 3.3–4.6 on Debian's 5.10–6.12. If it cannot be made, or `--full-btf` asks,
//! it is a copy of the whole.
//!
//! libbpf reads the BTF of each loaded module as split BTF on top of that
//! file. The part keeps every vmlinux type and string the modules present at
//! the minimizing refer to. A module loaded between the minimizing and the end
//! of the load is read over a part made without it: libbpf refuses its BTF where
//! it refers to a type the part left out, and with it every CO-RE relocation
//! (fentry and kprobe mode fail). The agent checks the modules
//! after the load ([`MappableBtf::modules_added`]) and, if any came, makes the
//! part again and loads again ([`MappableBtf::remake`]). A module unloaded and
//! loaded again under its name counts as come: its BTF is a new file (a new
//! inode in sysfs), maybe of another build.
//!
//! Nothing outside the agent sees the change. The mount namespace is the
//! agent's own (mounts from the host still propagate into it, none leave it),
//! and the bind mount is removed once the BPF programs are loaded.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::Seek;
use std::path::{Path, PathBuf};

use crate::btf_min;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// While it lives, `/sys/kernel/btf/vmlinux` is a mappable copy (for this process).
pub struct MappableBtf {
    /// The private tmpfs holding the copy (an empty directory outside this process).
    dir: PathBuf,
    /// What is mounted, in this process's own namespace only: only that is undone.
    tmpfs: bool,
    bound: bool,
    /// The modules whose BTF the part was made for, with their files' inodes
    /// (`Some` for a part only).
    modules: Option<ModuleBtfs>,
    /// Copies made (each a new file: a mapping of the last one, if any were
    /// left, must not see it truncated).
    made: u32,
}

impl MappableBtf {
    /// The modules with BTF that the kernel has now and the part was not made for
    /// (none when the whole BTF is bound).
    pub fn modules_added(&self) -> Vec<String> {
        match &self.modules {
            Some(had) => added_since(had, &module_btfs()),
            None => Vec::new(),
        }
    }

    /// Makes the part again, for the modules the kernel has now (`want`: the
    /// names it keeps whole; None: a copy of the whole BTF, which no module can
    /// outdate), and binds it in place of the last one (the programs loaded over
    /// that one must be gone: libbpf keeps no mapping of it past a load). The
    /// process already has its own mount namespace, so this works with threads
    /// running.
    pub fn remake(&mut self, want: Option<&HashSet<String>>) -> Result<BtfCopy, String> {
        if self.bound {
            umount2(VMLINUX_BTF, MntFlags::MNT_DETACH)
                .map_err(|e| format!("unbinding the part from {VMLINUX_BTF}: {e}"))?;
            self.bound = false;
        }
        let src = File::open(VMLINUX_BTF).map_err(|e| format!("{VMLINUX_BTF}: {e}"))?;
        write_and_bind(src, want, self)
    }
}

impl Drop for MappableBtf {
    fn drop(&mut self) {
        if self.bound {
            let _ = umount2(VMLINUX_BTF, MntFlags::MNT_DETACH);
        }
        if self.tmpfs {
            let _ = umount2(&self.dir, MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// What is bound over the kernel's BTF.
pub enum BtfCopy {
    /// The part the agent uses.
    Minimized(btf_min::Summary),
    /// The whole of it: asked for, or why the minimized copy could not be made.
    Whole(Option<String>),
}

/// What [`mappable_vmlinux_btf`] did.
pub enum Outcome {
    /// The kernel maps its BTF itself (or has none): nothing to do.
    NotNeeded,
    /// The copy is in place until the guard is dropped.
    Bound(MappableBtf, BtfCopy),
    /// Left as it is (libbpf reads and copies the BTF), and why.
    Skipped(String),
}

/// Binds the part of the kernel's BTF that has the types named `want` (the
/// whole BTF if None) over it, for this process. Must run before the process
/// has a second thread (a mount namespace is per process: `unshare` refuses a
/// multi-threaded caller).
pub fn mappable_vmlinux_btf(want: Option<&HashSet<String>>) -> Outcome {
    let Ok(f) = File::open(VMLINUX_BTF) else {
        return Outcome::NotNeeded;
    };
    match kernel_maps(&f) {
        Ok(true) => return Outcome::NotNeeded,
        Ok(false) => {}
        Err(e) => return Outcome::Skipped(format!("{VMLINUX_BTF}: {e}")),
    }
    let base = ["/run", "/tmp"]
        .into_iter()
        .find(|d| Path::new(d).is_dir())
        .unwrap_or("/tmp");
    let dir = PathBuf::from(format!("{base}/viotrace-btf.{}", std::process::id()));
    if let Err(e) = std::fs::create_dir(&dir) {
        return Outcome::Skipped(format!("{}: {e}", dir.display()));
    }
    let mut guard = MappableBtf {
        dir,
        tmpfs: false,
        bound: false,
        modules: None,
        made: 0,
    };
    match bind_copy(f, want, &mut guard) {
        Ok(copy) => Outcome::Bound(guard, copy),
        Err(e) => Outcome::Skipped(e), // (the guard undoes what was done)
    }
}

/// Whether the kernel lets `f` be mapped (it does from 6.16).
fn kernel_maps(f: &File) -> std::io::Result<bool> {
    let len = f.metadata()?.len() as usize;
    let Some(len) = std::num::NonZeroUsize::new(len) else {
        return Ok(false);
    };
    // SAFETY: a new private read-only mapping of a file we opened; it is
    // unmapped at once and never read.
    match unsafe { mmap(None, len, ProtFlags::PROT_READ, MapFlags::MAP_PRIVATE, f, 0) } {
        Ok(p) => {
            // SAFETY: `p` is the mapping of `len` bytes made above, not used after.
            let _ = unsafe { munmap(p, len.get()) };
            Ok(true)
        }
        Err(_) => Ok(false),
    }
}

/// In a mount namespace of this process: a tmpfs on the guard's directory,
/// the BTF (minimized for `want`) written into it, and bound over the kernel's file.
fn bind_copy(
    src: File,
    want: Option<&HashSet<String>>,
    g: &mut MappableBtf,
) -> Result<BtfCopy, String> {
    let dir = g.dir.clone();
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("own mount namespace: {e}"))?;
    // Nothing mounted here may reach the host's namespace.
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_SLAVE, none)
        .map_err(|e| format!("mount propagation: {e}"))?;
    mount(
        Some("tmpfs"),
        &dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=0700"),
    )
    .map_err(|e| format!("tmpfs on {}: {e}", dir.display()))?;
    g.tmpfs = true;
    write_and_bind(src, want, g)
}

/// The BTF (minimized for `want`, for the modules the kernel has now) written
/// into the guard's tmpfs and bound over the kernel's file.
fn write_and_bind(
    mut src: File,
    want: Option<&HashSet<String>>,
    g: &mut MappableBtf,
) -> Result<BtfCopy, String> {
    if g.made > 0 {
        let _ = std::fs::remove_file(g.dir.join(format!("vmlinux.{}", g.made - 1)));
    }
    let copy = g.dir.join(format!("vmlinux.{}", g.made));
    g.made += 1;
    let mut dst = File::create(&copy).map_err(|e| format!("{}: {e}", copy.display()))?;
    g.modules = None;
    let made = match want {
        Some(names) => {
            let modules = module_btfs();
            let paths: Vec<PathBuf> = modules.keys().cloned().collect();
            match btf_min::minimize(Path::new(VMLINUX_BTF), &paths, names, &dst) {
                Ok(s) => {
                    g.modules = Some(modules);
                    Ok(BtfCopy::Minimized(s))
                }
                Err(e) => dst.set_len(0).map(|()| BtfCopy::Whole(Some(e.to_string()))),
            }
        }
        None => Ok(BtfCopy::Whole(None)),
    };
    let made = made.map_err(|e| format!("{}: {e}", copy.display()))?;
    if let BtfCopy::Whole(_) = made {
        dst.rewind()
            .map_err(|e| format!("{}: {e}", copy.display()))?;
        std::io::copy(&mut src, &mut dst).map_err(|e| format!("copying {VMLINUX_BTF}: {e}"))?;
    }
    drop(dst);
    let none: Option<&str> = None;
    mount(Some(&copy), VMLINUX_BTF, none, MsFlags::MS_BIND, none)
        .map_err(|e| format!("binding the copy over {VMLINUX_BTF}: {e}"))?;
    g.bound = true;
    Ok(made)
}

/// Module BTF files (split BTF on top of vmlinux's) and their inodes.
type ModuleBtfs = BTreeMap<PathBuf, u64>;

/// The names of the modules in `now` that `had` lacks, or had as another file
/// (unloaded and loaded again).
fn added_since(had: &ModuleBtfs, now: &ModuleBtfs) -> Vec<String> {
    now.iter()
        .filter(|(p, ino)| had.get(*p) != Some(*ino))
        .filter_map(|(p, _)| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect()
}

/// The module BTFs the kernel has now.
fn module_btfs() -> ModuleBtfs {
    use std::os::unix::fs::DirEntryExt;
    let Ok(dir) = std::fs::read_dir("/sys/kernel/btf") else {
        return ModuleBtfs::new();
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name() != "vmlinux")
        .map(|e| (e.path(), e.ino()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_modules_the_part_was_not_made_for_count_as_added() {
        let set = |v: &[&str]| -> ModuleBtfs {
            v.iter()
                .map(|m| (Path::new("/sys/kernel/btf").join(m), m.len() as u64))
                .collect()
        };
        let had = set(&["virtio_blk", "virtio_ring"]);
        assert!(added_since(&had, &had).is_empty());
        // (a module gone since is no harm: libbpf does not read it)
        assert!(added_since(&had, &set(&["virtio_blk"])).is_empty());
        assert_eq!(
            added_since(&had, &set(&["virtio_blk", "vsock", "virtio_ring", "nbd"])),
            ["nbd", "vsock"]
        );
        // unloaded and loaded again: a new file under the same name
        let mut again = had.clone();
        again.insert(Path::new("/sys/kernel/btf/virtio_ring").to_path_buf(), 99);
        assert_eq!(added_since(&had, &again), ["virtio_ring"]);
    }
}
