//! The attach modes, the kernel-function hooks with their fentry and kprobe
//! flavours, and the probes of what this kernel offers (kallsyms, BTF, program
//! types).

use std::collections::HashMap;
use std::fmt;
use std::io::BufRead;
use std::path::Path;

use clap::ValueEnum;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Probe the kernel: fentry, else kprobe, else tracepoint.
    Auto,
    Fentry,
    Kprobe,
    Tracepoint,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Auto => "auto",
            Mode::Fentry => "fentry",
            Mode::Kprobe => "kprobe",
            Mode::Tracepoint => "tracepoint",
        })
    }
}

/// A kernel function hook with a fentry and a kprobe flavour.
#[derive(Debug)]
pub struct Hook {
    /// Kernel function.
    pub target: &'static str,
    /// Program names of the fentry/fexit flavour.
    pub fentry: &'static [&'static str],
    /// Program names of the kprobe/kretprobe flavour.
    pub kprobe: &'static [&'static str],
    /// What is lost without it.
    pub sees: &'static str,
    /// Its target is one of several paths (batched submit): a kernel without
    /// the function has no such path, so nothing is lost.
    pub alt_path: bool,
}

/// Driver-level hooks. Everything else (syscalls, block tracepoints) uses raw
/// tracepoints and runs in every mode.
pub const HOOKS: &[Hook] = &[
    Hook {
        target: "virtio_queue_rq",
        fentry: &["fe_queue_rq"],
        kprobe: &["kp_queue_rq"],
        sees: "g.queue_rq (single-request submit path)",
        alt_path: false,
    },
    Hook {
        target: "virtio_queue_rqs",
        fentry: &["fe_queue_rqs"],
        kprobe: &["kp_queue_rqs"],
        sees: "g.queue_rq (batched submit path)",
        alt_path: true,
    },
    Hook {
        target: "virtqueue_add_sgs",
        fentry: &["fe_add_sgs"],
        kprobe: &["kp_add_sgs"],
        sees: "g.vq_add, queue index, descriptor head",
        alt_path: false,
    },
    Hook {
        target: "virtqueue_kick_prepare",
        fentry: &["fx_kick_prepare"],
        kprobe: &["kp_kick_prepare", "krp_kick_prepare"],
        sees: "g.kick and whether it notified or was suppressed",
        alt_path: false,
    },
    Hook {
        target: "virtqueue_notify",
        fentry: &["fe_notify"],
        kprobe: &["kp_notify"],
        sees: "exact g.kick time of real notifications",
        alt_path: false,
    },
    Hook {
        target: "vring_interrupt",
        fentry: &["fe_vring_interrupt"],
        kprobe: &["kp_vring_interrupt"],
        sees: "g.irq",
        alt_path: false,
    },
    Hook {
        target: "blk_mq_complete_request",
        fentry: &["fe_complete_request"],
        kprobe: &["kp_complete_request"],
        sees: "g.driver_complete",
        alt_path: false,
    },
    Hook {
        target: "aio_prep_rw",
        fentry: &["fe_aio_prep_rw"],
        kprobe: &["kp_aio_prep_rw"],
        sees: "file and offset of each read/write iocb after the first in one io_submit",
        alt_path: false,
    },
    Hook {
        target: "blk_update_request",
        fentry: &["fx_update_request"],
        kprobe: &["kp_update_request", "krp_update_request"],
        sees: "g.bio_complete",
        alt_path: false,
    },
];

/// A traced I/O syscall in fentry mode: an entry and an exit program on its
/// x86-64 wrapper, so no other syscall runs a program (the raw `sys_enter` and
/// `sys_exit` tracepoints run one for every syscall of every task).
#[derive(Debug)]
pub struct SysHook {
    /// The wrapper (`__x64_sys_<name>`).
    pub target: &'static str,
    /// Its fentry program.
    pub enter: &'static str,
    /// Its fexit program.
    pub exit: &'static str,
}

macro_rules! sys_hooks {
    ($($name:literal),* $(,)?) => {
        &[$(SysHook {
            target: concat!("__x64_sys_", $name),
            enter: concat!("fe_sys_", $name),
            exit: concat!("fx_sys_", $name),
        }),*]
    };
}

/// The I/O syscalls (`SYS_PROGS` in bpf/guest/guest_task.h).
pub const SYSCALLS: &[SysHook] = sys_hooks![
    "read",
    "write",
    "pread64",
    "pwrite64",
    "readv",
    "writev",
    "fsync",
    "fdatasync",
    "io_submit",
    "sync_file_range",
    "preadv",
    "pwritev",
    "preadv2",
    "pwritev2",
    "io_uring_enter",
];

/// The raw syscall tracepoint programs: every mode loads them; fentry mode
/// attaches them only when the per-syscall programs cannot run.
pub const SYS_TP_PROGS: [&str; 2] = ["sys_enter", "sys_exit"];

/// A kernel function found in /proc/kallsyms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sym {
    /// Module name, or `vmlinux`.
    pub module: String,
    /// Address (0 when kallsyms hides addresses).
    pub addr: u64,
}

/// Module (or `vmlinux`) and address of each wanted kernel function, from
/// /proc/kallsyms (streamed: the file is several MB).
pub fn find_symbols<R: BufRead>(kallsyms: R, wanted: &[&str]) -> HashMap<String, Sym> {
    let mut out = HashMap::new();
    for line in kallsyms.lines() {
        let Ok(line) = line else { break };
        let mut it = line.split_whitespace();
        let (Some(addr), Some(ty), Some(name)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if !matches!(ty, "t" | "T") || !wanted.contains(&name) {
            continue;
        }
        let module = it
            .next()
            .map(|m| m.trim_matches(|c| c == '[' || c == ']').to_owned())
            .unwrap_or_else(|| "vmlinux".to_owned());
        let addr = u64::from_str_radix(addr, 16).unwrap_or(0);
        out.entry(name.to_owned()).or_insert(Sym { module, addr });
    }
    out
}

pub fn kprobes_available() -> bool {
    Path::new("/sys/bus/event_source/devices/kprobe").exists()
}

pub fn fentry_available() -> bool {
    libbpf_rs::ProgramType::Tracing
        .is_supported()
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kallsyms_parsing_keeps_module_and_text_only() {
        let ks = "ffffffffc0001000 t virtio_queue_rq\t[virtio_blk]\n\
                  ffffffff81000000 T blk_update_request\n\
                  ffffffff82000000 d vring_interrupt\n\
                  garbage\n";
        let s = find_symbols(
            ks.as_bytes(),
            &["virtio_queue_rq", "blk_update_request", "vring_interrupt"],
        );
        assert_eq!(
            s.get("virtio_queue_rq"),
            Some(&Sym {
                module: "virtio_blk".into(),
                addr: 0xffffffffc0001000
            })
        );
        assert_eq!(s["blk_update_request"].module, "vmlinux");
        assert!(!s.contains_key("vring_interrupt"));
    }

    #[test]
    fn every_hook_has_both_flavours_and_a_unique_target() {
        for h in HOOKS {
            assert!(!h.fentry.is_empty() && !h.kprobe.is_empty(), "{}", h.target);
            assert_eq!(HOOKS.iter().filter(|o| o.target == h.target).count(), 1);
        }
    }
}
