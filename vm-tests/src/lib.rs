//! The viotrace QEMU lab.
//!
//! Boots a real Linux guest (Debian 6.1 cloud kernel, busybox initramfs with fio)
//! under QEMU with a virtio-blk data disk and a guest↔host vsock channel, runs a
//! workload script and the viotrace agents, and collects what they produce.
//!
//! ```no_run
//! use viotrace_vm_tests::{Lab, VmConfig};
//! let lab = Lab::new()?;
//! let r = lab.run(&VmConfig::default(), "dd if=/dev/zero of=/data/f bs=4k count=10", "out".as_ref())?;
//! assert_eq!(r.workload_rc, 0);
//! # anyhow::Ok(())
//! ```

pub mod assets;
pub mod attack;
pub mod bench;
pub mod compat;
mod config;
pub mod cpu_split;
pub mod host_bpf;
pub mod host_threads;
pub mod insn;
pub mod interfere;
pub mod metrics;
mod pin;
mod proc;
mod qmp;
pub mod records;
mod result;
mod run;
pub mod vm;
pub mod vmlock;
pub mod workloads;

pub use vm::{
    read_jsonl, Accel, Agents, Aio, DiskFormat, HostAttach, Lab, RunResult, VmConfig, VsockMode,
};
