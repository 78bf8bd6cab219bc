//! Which hooks this kernel can run: the attach mode (fentry, kprobe,
//! tracepoint) and, per driver hook, whether its target function exists.

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
pub struct Hook {
    /// Kernel function.
    pub target: &'static str,
    /// Program names of the fentry/fexit flavour.
    pub fentry: &'static [&'static str],
    /// Program names of the kprobe/kretprobe flavour.
    pub kprobe: &'static [&'static str],
    /// What is lost without it.
    pub sees: &'static str,
}

/// Driver-level hooks. Everything else (syscalls, block tracepoints) uses raw
/// tracepoints and runs in every mode.
pub const HOOKS: &[Hook] = &[
    Hook {
        target: "virtio_queue_rq",
        fentry: &["fe_queue_rq"],
        kprobe: &["kp_queue_rq"],
        sees: "g.queue_rq (single-request submit path)",
    },
    Hook {
        target: "virtio_queue_rqs",
        fentry: &["fe_queue_rqs"],
        kprobe: &["kp_queue_rqs"],
        sees: "g.queue_rq (batched submit path)",
    },
    Hook {
        target: "virtqueue_add_sgs",
        fentry: &["fe_add_sgs"],
        kprobe: &["kp_add_sgs"],
        sees: "g.vq_add, queue index, descriptor head",
    },
    Hook {
        target: "virtqueue_kick_prepare",
        fentry: &["fx_kick_prepare"],
        kprobe: &["kp_kick_prepare", "krp_kick_prepare"],
        sees: "g.kick and whether it notified or was suppressed",
    },
    Hook {
        target: "virtqueue_notify",
        fentry: &["fe_notify"],
        kprobe: &["kp_notify"],
        sees: "exact g.kick time of real notifications",
    },
    Hook {
        target: "vring_interrupt",
        fentry: &["fe_vring_interrupt"],
        kprobe: &["kp_vring_interrupt"],
        sees: "g.irq",
    },
    Hook {
        target: "blk_mq_complete_request",
        fentry: &["fe_complete_request"],
        kprobe: &["kp_complete_request"],
        sees: "g.driver_complete",
    },
    Hook {
        target: "io_submit_one",
        fentry: &["fe_io_submit_one"],
        kprobe: &["kp_io_submit_one"],
        sees: "file and offset of each iocb after the first in one io_submit",
    },
    Hook {
        target: "blk_update_request",
        fentry: &["fx_update_request"],
        kprobe: &["kp_update_request", "krp_update_request"],
        sees: "g.bio_complete",
    },
];

/// Optional tracepoint programs, by group: a group is blind only when none of
/// its programs attaches (tracepoints get renamed across kernels).
pub const OPTIONAL_TPS: &[(&[&str], &str)] = &[(
    &["uring_submit", "uring_submit_sqe"],
    "file and offset of io_uring requests (io_uring:io_uring_submit_req/_sqe)",
)];

/// Whether `prog` is an optional program (a driver hook flavour or an optional tracepoint).
pub fn is_optional(prog: &str) -> bool {
    prog == "irq_entry"
        || OPTIONAL_TPS.iter().any(|(p, _)| p.contains(&prog))
        || HOOKS
            .iter()
            .any(|h| h.fentry.contains(&prog) || h.kprobe.contains(&prog))
}

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

/// Why a hook target cannot be used in `mode`, if it cannot.
pub fn unusable(mode: Mode, target: &str, syms: &HashMap<String, Sym>) -> Option<String> {
    let Some(Sym { module, .. }) = syms.get(target) else {
        return Some(format!(
            "{target} not in /proc/kallsyms (module not loaded or function inlined)"
        ));
    };
    if mode == Mode::Fentry && !Path::new("/sys/kernel/btf").join(module).exists() {
        return Some(format!("no BTF for {module} (/sys/kernel/btf/{module})"));
    }
    None
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
        assert!(unusable(Mode::Kprobe, "vring_interrupt", &s).is_some());
        assert!(unusable(Mode::Kprobe, "virtio_queue_rq", &s).is_none());
    }
}
