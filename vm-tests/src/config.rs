//! What a lab run is: the VM, the agents and how they attach.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Result;
use serde::Serialize;

use crate::assets::{GuestKernel, QemuBuild};

/// Which agents run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Agents {
    None,
    Guest,
    Host,
    /// Both agents, joined over vsock.
    Both,
    /// Both agents, each alone (not joined): what joining adds over running both.
    Apart,
}

impl Agents {
    pub fn guest(self) -> bool {
        matches!(self, Agents::Guest | Agents::Both | Agents::Apart)
    }
    pub fn host(self) -> bool {
        matches!(self, Agents::Host | Agents::Both | Agents::Apart)
    }
}

/// QEMU's block backend I/O mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Aio {
    Threads,
    Native,
    #[value(name = "io_uring")]
    IoUring,
}

impl fmt::Display for Aio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Aio::Threads => "threads",
            Aio::Native => "native",
            Aio::IoUring => "io_uring",
        })
    }
}

/// Data disk image format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DiskFormat {
    Raw,
    Qcow2,
}

impl DiskFormat {
    /// QEMU's name of the format (also the image's file extension).
    pub fn name(self) -> &'static str {
        match self {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        }
    }
}

/// How the guest↔host vsock channel is provided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum VsockMode {
    /// Kernel vhost-vsock when /dev/vhost-vsock works, else vhost-user (hybrid vsock).
    Auto,
    /// vhost-device-vsock: hybrid vsock over a Unix socket.
    VhostUser,
    /// The host kernel's vhost-vsock (`vhost-vsock-pci`, real AF_VSOCK on the host).
    Kernel,
    None,
}

/// QEMU accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Accel {
    Auto,
    Kvm,
    Tcg,
}

impl Accel {
    /// QEMU's `-accel` value: `Auto` is KVM where this host can run it, else TCG.
    pub fn resolve(self) -> &'static str {
        match self {
            Accel::Auto if crate::vm::kvm_usable() => "kvm",
            Accel::Auto | Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }
}

/// When the host agent attaches to QEMU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum HostAttach {
    /// QEMU starts paused (-S); the agent attaches by pid; then the VM is resumed.
    Paused,
    /// The agent starts first in discovery mode (no pid) and must find QEMU by itself.
    BeforeQemu,
    /// The agent attaches by pid to a running VM once the workload has started.
    Running,
}

/// Everything about one lab run.
#[derive(Clone, Debug, Serialize)]
pub struct VmConfig {
    pub name: String,
    pub smp: u32,
    pub queues: u32,
    pub memory_mib: u32,
    pub aio: Aio,
    /// QEMU cache mode for the data disk (`writeback`, `none`, `directsync`, …). With
    /// `aio=native` the lab forces `cache.direct=on` (`none`) as QEMU requires.
    pub cache: String,
    pub format: DiskFormat,
    /// Serve the virtio-blk disks from an IOThread (`-object iothread` and the device's
    /// `iothread=`, as libvirt's `<driver iothread=…>`) instead of QEMU's main loop.
    pub iothread: bool,
    /// The data disk behind QEMU's blkdebug driver, so that the workload can hold one of
    /// its requests in QEMU: console lines `VIOTRACE-QEMU-IO <qemu-io command>` run
    /// qemu-io's `break <event> <tag>` / `resume <tag>` on it (see `run.rs`).
    pub blkdebug: bool,
    pub agents: Agents,
    /// The guest agent writes JSON records to guest.jsonl (default). Off: it keeps only its
    /// periodic per-stage tables (guest.log) — the always-on configuration the bench measures.
    pub guest_json: bool,
    /// The guest agent also captures every record (`--capture /out/guest.cap`); the lab
    /// decodes the capture into `guest.cap.jsonl` (the JSON lines `--json` prints).
    pub guest_capture: bool,
    /// With `guest_capture`: decode it into `guest.cap.jsonl` (default). Off: the run
    /// leaves only `guest.cap` (the bench reads it itself; its JSON would be ~6× larger).
    pub decode_capture: bool,
    /// The host agent writes a JSON line per element to host.jsonl (default). Off: per-stage
    /// tables only (the host side of the always-on configuration the bench measures).
    pub host_json: bool,
    /// Extra guest agent arguments: shell words evaluated by the guest's shell when the
    /// agent starts (after `setup`), so `--pid $(cat /run/x.pid)` works.
    pub guest_args: String,
    pub host_args: Vec<String>,
    /// Extra environment variables of the host agent (its test hooks), per run: never
    /// set on the test process, whose tests run in parallel threads.
    pub host_env: Vec<(String, String)>,
    pub host_attach: HostAttach,
    /// Shell script run in the guest before the guest agent starts (e.g. create cgroups).
    pub setup: Option<String>,
    /// Shell script run in the guest after the workload's end marker, the guest agent
    /// still running: outside the measured window (e.g. the bench's BPF accounting pass).
    /// Its exit status goes to `post.rc` in the results, its output to `post.log`.
    pub post: Option<String>,
    /// Size of an extra blank raw virtio-blk disk (`vdb`, not formatted), MiB.
    pub extra_disk_mib: Option<u32>,
    /// Host programs copied into the guest with their libraries (e.g. `bpftrace`).
    pub guest_tools: Vec<String>,
    /// Fixed hybrid-vsock Unix socket path of the vhost-user backend (default: in the
    /// run's private directory). Guest connections to port P arrive on `<path>_P`.
    pub vsock_uds: Option<PathBuf>,
    pub timeout: Duration,
    /// A guest whose init has not said it booted (kernel, modules and disks up) this long
    /// after it started has hung: the run stops and boots it again, once (see `Lab::run`).
    pub boot_timeout: Duration,
    pub vsock: VsockMode,
    pub accel: Accel,
    /// Echo the guest console (and agents' stdout when not captured) live.
    pub console: bool,
    /// Guest CID (vsock).
    pub cid: u32,
    /// Extra QEMU arguments (appended).
    pub qemu_args: Vec<String>,
    /// The guest kernel (default: Debian 12's 6.1 cloud kernel).
    pub guest_kernel: GuestKernel,
    /// The QEMU build (default: the host's, Debian 12's 7.2).
    pub qemu: QemuBuild,
    /// The guest CPU model (`-cpu`); `None`: the lab's (`cpu_arg`).
    pub cpu: Option<String>,
    /// Each vCPU thread on a host CPU of its own, everything else the run starts on the
    /// others (see `pin.rs`); the run's `pin.txt` says where. Needs more host CPUs than vCPUs.
    pub pin_vcpus: bool,
    /// Sample the host agent's threads with perf between the workload's
    /// `VIOTRACE-HOST-BPF-SAMPLE start` and `end` lines (the bench's accounting pass,
    /// after the measured window), for its user/kernel split (`host-agent.perf.data`;
    /// see `cpu_split.rs`).
    pub sample_host_cpu: bool,
    /// The guest and host agent binaries to run; `None`: built from the workspace for the
    /// run (the bench builds them once and passes them, see `bench::run`).
    pub guest_bin: Option<PathBuf>,
    pub host_bin: Option<PathBuf>,
    /// Count the guest's instructions with QEMU's TCG plugin (`insn.rs`): the run's
    /// `insn.txt` gets the counts at each mark the guest makes (`viotrace-insn-mark`, in
    /// the guest's PATH). TCG and QEMU builds before 9.0 only.
    pub insn_count: bool,
    /// With `insn_count`: also a profile of the guest's instructions by block address at
    /// each mark (`insn-profile.txt`; `docs/experiments/insn-profile.py` symbolizes it).
    pub insn_profile: bool,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            name: "viotrace-lab".into(),
            smp: 1,
            queues: 1,
            memory_mib: 1024,
            aio: Aio::Threads,
            cache: "writeback".into(),
            format: DiskFormat::Raw,
            blkdebug: false,
            agents: Agents::None,
            guest_json: true,
            guest_capture: false,
            decode_capture: true,
            host_json: true,
            guest_args: String::new(),
            host_args: Vec::new(),
            host_env: Vec::new(),
            host_attach: HostAttach::Paused,
            setup: None,
            post: None,
            extra_disk_mib: None,
            guest_tools: Vec::new(),
            vsock_uds: None,
            timeout: Duration::from_secs(600),
            boot_timeout: crate::vm::BOOT_DEADLINE,
            vsock: VsockMode::Auto,
            accel: Accel::Auto,
            console: false,
            cid: 3,
            qemu_args: Vec::new(),
            iothread: false,
            guest_kernel: GuestKernel::default(),
            qemu: QemuBuild::default(),
            cpu: None,
            pin_vcpus: false,
            sample_host_cpu: false,
            guest_bin: None,
            host_bin: None,
            insn_count: false,
            insn_profile: false,
        }
    }
}

impl VmConfig {
    /// The IOThread of the virtio-blk disks (`iothread`).
    pub(crate) const IOTHREAD_ID: &'static str = "vt-io0";

    /// QEMU's `-drive` and `-device` arguments of a virtio-blk disk backed by `file`.
    pub(crate) fn disk_args(&self, file: &std::path::Path, id: &str, dev: &str) -> [String; 4] {
        let cache = if self.aio == Aio::Native {
            "none"
        } else {
            self.cache.as_str()
        };
        let mut device = format!(
            "virtio-blk-pci,drive={id},id={dev},num-queues={}",
            self.queues
        );
        if self.iothread {
            device += &format!(",iothread={}", Self::IOTHREAD_ID);
        }
        // (blkdebug's legacy filename syntax: no rules file, the image)
        let debug = if self.blkdebug && id == "data" {
            "blkdebug::"
        } else {
            ""
        };
        [
            "-drive".into(),
            format!(
                "file={debug}{},if=none,id={id},format={},aio={},cache={cache}",
                file.display(),
                self.format.name(),
                self.aio
            ),
            "-device".into(),
            device,
        ]
    }

    /// The guest's `viotrace/config.sh` (read by init.sh): the data disk, whether the guest
    /// agent runs (`agent`), its arguments and outputs, and when a hung run dumps state.
    pub(crate) fn guest_config_sh(&self, agent: bool) -> String {
        use crate::vm::{shell_quote, AGENT_VSOCK_PORT};
        let mut conf = String::from("VIOTRACE_DISK=vda\n");
        conf += &format!("VIOTRACE_GUEST_AGENT={}\n", u8::from(agent));
        let mut gargs = self.guest_args.clone();
        if self.agents == Agents::Both {
            gargs += &format!(" --connect vsock:2:{AGENT_VSOCK_PORT}");
        }
        conf += &format!("VIOTRACE_GUEST_ARGS={}\n", shell_quote(&gargs));
        let output = [
            (self.guest_json, "--json"),
            (self.guest_capture, "--capture /out/guest.cap"),
        ];
        let output: Vec<&str> = output.iter().filter(|o| o.0).map(|o| o.1).collect();
        conf += &format!("VIOTRACE_GUEST_OUTPUT={}\n", shell_quote(&output.join(" ")));
        // 30 s before the run's deadline the guest dumps its disks' requests in
        // flight and its user tasks' states and kernel stacks to the console,
        // so that a hung workload leaves evidence in serial.log (init.sh).
        conf += &format!(
            "VIOTRACE_DUMP_AFTER={}\n",
            self.timeout.as_secs().saturating_sub(30).max(10)
        );
        conf
    }
}

/// QEMU's `-smp` value. Under TCG a single-vCPU guest is given a second, absent CPU slot
/// (`maxcpus=2`): QEMU translates a 1-CPU guest without `CF_PARALLEL`, and then a guest's locked
/// instruction is a plain load and store with no host barrier. Linux's `virtio_mb()` on x86 is
/// `lock addl $0,-4(%rsp)`, so the guest's virtio ring loses its store→load order against QEMU's
/// I/O threads (a host x86 CPU may reorder those), and an event-index notification can be lost:
/// requests complete on the used ring and the guest is never told (seen as a lab hang on
/// QEMU 7.2; QEMU 8.1+ emit explicit fences but still not locked instructions, checked on 10.0
/// with `-d op`). With `maxcpus > 1` QEMU translates with `CF_PARALLEL`: locked instructions
/// become host atomics, which are full barriers. The guest still has one online CPU.
pub fn smp_arg(smp: u32, accel: &str) -> String {
    if accel == "tcg" && smp == 1 {
        "1,maxcpus=2".into()
    } else {
        smp.to_string()
    }
}

/// The guest CPU model under TCG: QEMU's `max` without ERMS (enhanced `rep movsb`/`stosb`)
/// and FSRM (fast short `rep movsb`, in `max` since QEMU 8: with it but without ERMS the 6.1
/// guest kernel hung before its first console line on QEMU 10.0).
/// With ERMS the guest kernel copies and clears memory with `rep movsb`/`rep stosb`
/// (`copy_user_enhanced_fast_string`, `clear_page_erms`, `memset_erms`), which QEMU 7.2's TCG
/// runs one byte per emulated iteration, where a CPU with ERMS moves tens of bytes a cycle: a
/// guest program's cost then grows with the bytes it writes far beyond what it would on
/// hardware (a capture file in the lab's RAM file system cost capture 0.10 of its IOPS ratio
/// at randread QD32, docs/PERFORMANCE.md). Without ERMS the kernel takes its `REP_GOOD` paths
/// (`rep movsq`/`stosq`, eight bytes an iteration; QEMU 7.2's `max`) or its unrolled loops
/// (10.0 and 11.x, whose `max` lacks `REP_GOOD`), as on CPUs without ERMS.
pub const TCG_CPU: &str = "max,-erms,-fsrm";

/// QEMU's `-cpu` value: `cpu` if given, else the host's under KVM and [`TCG_CPU`] under TCG.
pub fn cpu_arg(cpu: Option<&str>, accel: &str) -> String {
    match cpu {
        Some(c) => c.to_string(),
        None if accel == "kvm" => "host".into(),
        None => TCG_CPU.into(),
    }
}

impl FromStr for Agents {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        <Agents as clap::ValueEnum>::from_str(s, true).map_err(|e| anyhow::anyhow!(e))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn guest_config_names_the_agents_outputs() {
        let cfg = super::VmConfig {
            agents: super::Agents::Both,
            guest_json: false,
            guest_capture: true,
            guest_args: "-c fio".into(),
            ..super::VmConfig::default()
        };
        let conf = cfg.guest_config_sh(true);
        assert!(conf.contains("VIOTRACE_GUEST_AGENT=1\n"), "{conf}");
        assert!(conf.contains("--connect vsock:2:5515"), "{conf}");
        assert!(
            conf.contains("VIOTRACE_GUEST_OUTPUT='--capture /out/guest.cap'\n"),
            "{conf}"
        );
        let both = super::VmConfig {
            guest_json: true,
            ..cfg
        };
        assert!(
            both.guest_config_sh(true)
                .contains("VIOTRACE_GUEST_OUTPUT='--json --capture /out/guest.cap'\n"),
            "{}",
            both.guest_config_sh(true)
        );
        let none = super::VmConfig {
            guest_json: false,
            guest_capture: false,
            ..super::VmConfig::default()
        };
        let conf = none.guest_config_sh(false);
        assert!(conf.contains("VIOTRACE_GUEST_AGENT=0\n"), "{conf}");
    }

    #[test]
    fn blkdebug_wraps_the_data_disk_only() {
        let cfg = super::VmConfig {
            blkdebug: true,
            ..super::VmConfig::default()
        };
        let p = std::path::Path::new("/run/d.raw");
        let data = cfg.disk_args(p, "data", "vdata");
        assert!(
            data[1].starts_with("file=blkdebug::/run/d.raw,"),
            "{data:?}"
        );
        assert!(data[1].contains(",format=raw,"), "{data:?}");
        let extra = cfg.disk_args(p, "extra", "vextra");
        assert!(extra[1].starts_with("file=/run/d.raw,"), "{extra:?}");
        let plain = super::VmConfig::default().disk_args(p, "data", "vdata");
        assert!(plain[1].starts_with("file=/run/d.raw,"), "{plain:?}");
    }

    use super::{cpu_arg, smp_arg};

    #[test]
    fn the_cpu_model_is_the_hosts_under_kvm_and_max_without_erms_under_tcg() {
        assert_eq!(cpu_arg(None, "kvm"), "host");
        assert_eq!(cpu_arg(None, "tcg"), "max,-erms,-fsrm");
        assert_eq!(cpu_arg(Some("max"), "tcg"), "max");
    }

    #[test]
    fn a_single_tcg_vcpu_gets_a_second_slot() {
        assert_eq!(smp_arg(1, "tcg"), "1,maxcpus=2");
        assert_eq!(smp_arg(2, "tcg"), "2");
        assert_eq!(smp_arg(1, "kvm"), "1");
    }
}
