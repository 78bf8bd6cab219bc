//! What the running kernel offers, gathered once at start-up: its release,
//! which program types work, where each hooked function lives (kallsyms),
//! which modules carry BTF, and the argument lists of the tracepoints whose
//! prototypes changed across kernels (from the vmlinux BTF `btf_trace_*`
//! typedefs, which is what raw tracepoint programs receive).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::Path;

use anyhow::{Context, Result};
use libbpf_rs::btf::types::{Func, FuncProto, Ptr, Typedef};
use libbpf_rs::btf::{BtfKind, BtfType, ReferencesType, TypeId};
use libbpf_rs::Btf;

use crate::plan;
use crate::probe::{self, Sym, HOOKS, SYSCALLS};

/// Tracepoints whose argument lists the plan looks at.
pub const TRACEPOINTS: &[&str] = &[
    "block_bio_queue",
    "block_split",
    "block_bio_backmerge",
    "block_bio_frontmerge",
    "io_uring_submit_req",
    "io_uring_submit_sqe",
    "irq_handler_entry",
];

/// The names [`Facts::gather`] looks up in the kernel's BTF: the `btf_trace_*`
/// typedef of each of [`TRACEPOINTS`], and the hooked and syscall functions.
pub fn btf_names() -> impl Iterator<Item = String> {
    TRACEPOINTS
        .iter()
        .map(|tp| format!("btf_trace_{tp}"))
        .chain(HOOKS.iter().map(|h| h.target.to_string()))
        .chain(SYSCALLS.iter().map(|s| s.target.to_string()))
}

/// One tracepoint argument: the struct a pointer argument points to, if any
/// (`void *` and scalars have none).
pub type TpArg = Option<String>;

/// The facts the attach plan is made from.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    /// Kernel release (`uname -r`).
    pub release: String,
    /// Fentry/fexit programs load on this kernel.
    pub fentry: bool,
    /// Kprobes exist on this kernel.
    pub kprobes: bool,
    /// Hooked functions found in /proc/kallsyms.
    pub syms: HashMap<String, Sym>,
    /// BTF objects under /sys/kernel/btf (`vmlinux` and modules).
    pub btf: HashSet<String>,
    /// Raw tracepoints of [`TRACEPOINTS`] this kernel has, with their arguments.
    pub tracepoints: BTreeMap<String, Vec<TpArg>>,
    /// Syscall wrappers whose `struct pt_regs *` argument this kernel's BTF
    /// leaves untyped (a forward declaration, as for `__x64_sys_io_submit` on
    /// Debian's 5.10): the verifier refuses an fentry program that reads it.
    pub sys_untyped_regs: BTreeSet<String>,
}

impl Facts {
    /// Probes the running kernel.
    pub fn gather() -> Result<Facts> {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .context("reading /proc/sys/kernel/osrelease")?
            .trim()
            .to_string();
        let ks = std::fs::File::open("/proc/kallsyms").context("opening /proc/kallsyms")?;
        let wanted: Vec<&str> = HOOKS
            .iter()
            .map(|h| h.target)
            .chain(SYSCALLS.iter().map(|s| s.target))
            .chain(plan::TYPED_FILE_TARGETS)
            .chain(plan::VDEV_IRQ_HANDLERS)
            .collect();
        let syms = probe::find_symbols(std::io::BufReader::new(ks), &wanted);
        let btf = std::fs::read_dir("/sys/kernel/btf")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let vmlinux = Btf::from_vmlinux().context("reading the kernel's BTF")?;
        let tracepoints = TRACEPOINTS
            .iter()
            .filter_map(|tp| tp_args(&vmlinux, tp).map(|a| (tp.to_string(), a)))
            .collect();
        let sys_untyped_regs = SYSCALLS
            .iter()
            .filter(|s| !first_arg_is_struct(&vmlinux, s.target))
            .map(|s| s.target.to_string())
            .collect();
        Ok(Facts {
            release,
            fentry: probe::fentry_available(),
            kprobes: probe::kprobes_available(),
            syms,
            btf,
            tracepoints,
            sys_untyped_regs,
        })
    }

    /// (major, minor) of the release, (0, 0) if unparsable.
    pub fn version(&self) -> (u32, u32) {
        let mut it = self
            .release
            .split(|c: char| !c.is_ascii_digit())
            .map(|n| n.parse().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0))
    }

    /// Module (or `vmlinux`) holding `func`, if the kernel has it.
    pub fn module_of(&self, func: &str) -> Option<&str> {
        self.syms.get(func).map(|s| s.module.as_str())
    }

    /// Whether `module` (or `vmlinux`) carries BTF.
    pub fn has_btf(&self, module: &str) -> bool {
        self.btf.contains(module)
    }
}

/// Arguments of raw tracepoint `tp` (after the hidden `void *__data`), from
/// `typedef void (*btf_trace_<tp>)(void *, args...)`; None if the kernel has no such tracepoint.
fn tp_args(btf: &Btf<'_>, tp: &str) -> Option<Vec<TpArg>> {
    let td: Typedef<'_> = btf.type_by_name(&format!("btf_trace_{tp}"))?;
    let ptr = Ptr::try_from(td.referenced_type()).ok()?;
    let proto = FuncProto::try_from(ptr.referenced_type()).ok()?;
    let args = proto
        .iter()
        .skip(1)
        .map(|p| {
            struct_pointee(btf, p.ty)
                .and_then(|s| s.name().map(|n| n.to_string_lossy().into_owned()))
        })
        .collect();
    Some(args)
}

/// The struct or union type `ty` points to (through modifiers and typedefs), if
/// it is such a pointer: what the verifier lets a tracing program read.
fn struct_pointee<'b>(btf: &'b Btf<'_>, ty: TypeId) -> Option<BtfType<'b>> {
    let t: BtfType<'b> = btf.type_by_id(ty)?;
    let pointee = Ptr::try_from(t.skip_mods_and_typedefs())
        .ok()?
        .referenced_type()
        .skip_mods_and_typedefs();
    matches!(pointee.kind(), BtfKind::Struct | BtfKind::Union).then_some(pointee)
}

/// Whether function `func` of `btf` takes a pointer to a defined struct first
/// (true when the BTF has no such function: nothing to refuse it by; a
/// forward declaration is no struct).
fn first_arg_is_struct(btf: &Btf<'_>, func: &str) -> bool {
    let Some(f) = btf.type_by_name::<Func<'_>>(func) else {
        return true;
    };
    let Ok(proto) = FuncProto::try_from(f.referenced_type()) else {
        return true;
    };
    let Some(first) = proto.iter().next() else {
        return false;
    };
    struct_pointee(btf, first.ty).is_some()
}

/// Whether the running kernel's tracefs is mounted (tracepoint attach needs it on some kernels).
pub fn ensure_tracefs() {
    if !Path::new("/sys/kernel/tracing/events").exists() {
        let _ = std::process::Command::new("mount")
            .args(["-t", "tracefs", "none", "/sys/kernel/tracing"])
            .status();
    }
}
