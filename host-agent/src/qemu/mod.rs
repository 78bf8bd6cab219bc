//! Finding QEMU processes and learning what can be traced in them: command line
//! ([`cmdline`]), process and binary paths ([`proc`]), exported symbols, version
//! and call sites ([`binary`]), the private structure layouts per release
//! ([`layout`]) confirmed from machine code ([`decode`]), USDT probes ([`usdt`]), and the runtime check
//! of a layout on a VM's first requests ([`verify`]).

pub mod binary;
pub mod cmdline;
pub mod decode;
mod elf_file;
pub mod layout;
pub mod probe_site;
pub mod proc;
pub mod usdt;
pub mod verify;

pub use binary::BinaryInfo;
pub use layout::Layout;
pub use proc::{cpu_ticks, device_drive, discover, is_qemu, Liveness, QemuProc};
