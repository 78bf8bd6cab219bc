//! `viotrace-vm`: the viotrace QEMU lab from the command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use viotrace_vm_tests::{
    assets::{GuestKernel, QemuBuild},
    workloads, Accel, Agents, Aio, DiskFormat, HostAttach, Lab, VmConfig, VsockMode,
};

#[derive(Parser)]
#[command(
    name = "viotrace-vm",
    version,
    about = "viotrace QEMU lab: boot a test guest, run a workload and the agents"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a VM, run a workload script inside it (with the chosen agents) and collect the results.
    Run {
        /// Shell script to run as root in the guest (cwd /data; busybox and fio on PATH; $VIOTRACE_DISK).
        #[arg(short, long)]
        workload: PathBuf,
        #[command(flatten)]
        vm: VmArgs,
        /// Output directory.
        #[arg(short, long, default_value = "lab-out")]
        out: PathBuf,
    },
    /// The demo: both agents on a built-in mixed workload, with live output.
    Demo {
        #[command(flatten)]
        vm: VmArgs,
        #[arg(short, long, default_value = "lab-out/demo")]
        out: PathBuf,
    },
    /// fio in the guest under alternated conditions (see --conditions): IOPS, latency and agent costs.
    Bench {
        #[command(flatten)]
        vm: VmArgs,
        /// Rounds: each runs every condition once, in order.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Seconds per fio job.
        #[arg(long, default_value_t = 5)]
        runtime: u32,
        /// Guest agent writes JSON records too (default: tables only, the always-on setup;
        /// in "both" the records go to the host over vsock either way).
        #[arg(long)]
        json: bool,
        /// Also measure the BPF run time per program, the guest agent's (bpftool in the
        /// guest) and the host agent's, in a pass of its own after each measured window.
        #[arg(long)]
        bpf_stats: bool,
        /// Conditions to alternate (none, guest, capture, json, host, both, apart, lean,
        /// lean-both, lean-capture, bpftrace; capture = the guest agent with --capture,
        /// json = with --json, apart = both agents not joined, lean = the guest agent
        /// with --skip-points lean, alone, joined and capturing).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "none,guest,capture,json,host,both,bpftrace"
        )]
        conditions: Vec<String>,
        /// Keep every round's record files (a capture round leaves ~270 MB, a json
        /// round ~220 MB); by default those over 1 MiB are removed once the round is read.
        #[arg(long)]
        keep_records: bool,
        #[arg(short, long, default_value = "lab-out/bench")]
        out: PathBuf,
    },
    /// Print the tables and checks of a bench run again from its bench.json (e.g. one
    /// made by an older viotrace-vm, or one still running). Several runs of the same
    /// conditions are pooled: their rounds together, as one longer run.
    BenchReport {
        /// The runs' bench.json files, or their directories.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Build and cache the lab's assets (guest kernel, initramfs, disk, vsock backend) without booting.
    Prepare {
        /// Also every guest kernel (5.10, 6.1, 6.12, 7.x) and QEMU build (10.0, 11.x) of the matrix.
        #[arg(long)]
        matrix: bool,
    },
    /// Attack a host agent's guest socket as a hostile guest would (record floods, forged
    /// clock samples, half-open connections, a reconnect storm), and print what was done.
    /// Only for your own host agent: the socket is a hybrid-vsock `<uds-path>_<port>` path.
    Attack {
        /// The host agent's guest socket.
        socket: PathBuf,
    },
    /// The compatibility table (guest kernels × QEMU builds × attach modes) as Markdown, from
    /// the run directories the lab tests left.
    Compat {
        /// A directory of lab runs (or one run directory); repeatable.
        /// Default: <workspace>/target/lab-tests.
        #[arg(long)]
        results: Vec<PathBuf>,
        /// Write the table here instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Args)]
struct VmArgs {
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    smp: u32,
    /// virtio-blk queues.
    #[arg(long, default_value_t = 1)]
    queues: u32,
    /// QEMU block I/O mode.
    #[arg(long, value_enum, default_value_t = Aio::Threads)]
    aio: Aio,
    /// QEMU cache mode of the data disk (writeback, none, directsync, writethrough, unsafe).
    #[arg(long, default_value = "writeback")]
    cache: String,
    /// Data disk image format.
    #[arg(long, value_enum, default_value_t = DiskFormat::Raw)]
    format: DiskFormat,
    /// Serve the virtio-blk disks from an IOThread instead of QEMU's main loop.
    #[arg(long)]
    iothread: bool,
    /// The data disk behind QEMU's blkdebug driver: the workload's `VIOTRACE-QEMU-IO <cmd>`
    /// console lines run qemu-io commands on it (`break read_aio t1`, `resume t1`).
    #[arg(long)]
    blkdebug: bool,
    /// Agents to run.
    #[arg(long, value_enum)]
    agents: Option<Agents>,
    /// The guest agent prints only its per-stage tables (guest.log), no JSON records.
    #[arg(long)]
    guest_tables_only: bool,
    /// The guest agent also captures every record (`--capture`), and the lab decodes the
    /// capture into guest.cap.jsonl.
    #[arg(long)]
    guest_capture: bool,
    /// The host agent runs always-on (no --json): its files get only the slow
    /// and the sampled records, every record still counts in its statistics.
    #[arg(long)]
    host_always_on: bool,
    /// Extra guest agent arguments, as shell words evaluated in the guest.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    guest_args: String,
    /// Extra host agent arguments (one shell-quoted string).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    host_args: String,
    /// Extra QEMU arguments, appended to the lab's command line (one shell-quoted
    /// string), e.g. "-global virtio-blk-pci.vectors=0".
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    qemu_args: String,
    /// Hard timeout for the whole VM run.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// A guest that has not booted (kernel, modules and disks up) this long after it
    /// started has hung: the run boots it again, once.
    #[arg(long, default_value = "3m", value_parser = humantime::parse_duration)]
    boot_timeout: Duration,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 1024)]
    memory: u32,
    /// The guest CPU model (QEMU's `-cpu`). Default: `host` under KVM; under TCG
    /// `max,-erms,-fsrm` (with `max` the guest kernel copies with `rep movsb`, which TCG
    /// runs a byte an iteration; the lab's model before 2026-12-08).
    #[arg(long)]
    cpu: Option<String>,
    #[arg(long, value_enum, default_value_t = VsockMode::Auto)]
    vsock: VsockMode,
    #[arg(long, value_enum, default_value_t = Accel::Auto)]
    accel: Accel,
    /// Guest vsock CID.
    #[arg(long, default_value_t = 3)]
    cid: u32,
    /// When the host agent attaches.
    #[arg(long, value_enum, default_value_t = HostAttach::Paused)]
    host_attach: HostAttach,
    /// Script run in the guest before the guest agent starts.
    #[arg(long)]
    setup: Option<PathBuf>,
    /// Script run in the guest after the workload's end marker, outside its measured window,
    /// with the guest agent still running (e.g. statistics that would weigh on the workload);
    /// its output goes to `post.log`, its exit status to `post.rc`.
    #[arg(long)]
    post: Option<PathBuf>,
    /// Add a blank raw disk of this many MiB as the second virtio-blk disk (vdb).
    #[arg(long)]
    extra_disk: Option<u32>,
    /// Copy this host program (with its libraries) into the guest; repeatable.
    #[arg(long)]
    guest_tool: Vec<String>,
    /// Do not echo the guest console.
    #[arg(long)]
    quiet: bool,
    /// Guest kernel: Debian cloud kernel 5.10 (bullseye), 6.1 (bookworm), 6.12 (trixie),
    /// 7.x (sid's newest), or a package name linux-image-<release>.
    #[arg(long, default_value = "6.1")]
    guest_kernel: GuestKernel,
    /// QEMU: 7.2 (the host's qemu-system-x86_64), 10.0 (bookworm-backports, extracted),
    /// 11.x (sid's, run inside a debootstrapped sid root), or a path to a qemu-system-x86_64.
    #[arg(long, default_value = "7.2")]
    qemu: QemuBuild,
    /// Each vCPU thread on a host CPU of its own, everything else on the others (steadier
    /// figures; needs more host CPUs than vCPUs).
    #[arg(long)]
    pin_vcpus: bool,
    /// Sample the host agent's threads with perf between the workload's console lines
    /// `VIOTRACE-HOST-BPF-SAMPLE start` and `end`: its user and kernel share (the summary's
    /// host agent line; the bench does it in its accounting pass).
    #[arg(long)]
    sample_host_cpu: bool,
    /// Count the guest's instructions (QEMU's TCG plugin, QEMU 7.2/8.x): the run's insn.txt
    /// gets the counts at each `viotrace-insn-mark` the guest runs; the bench brackets each
    /// fio job with marks and reports guest instructions per I/O
    #[arg(long)]
    insn_count: bool,
    /// With --insn-count: also the guest's instructions by block address at each mark
    /// (insn-profile.txt), for docs/experiments/insn-profile.py
    #[arg(long, requires = "insn_count")]
    insn_profile: bool,
}

impl VmArgs {
    fn config(&self, default_agents: Agents, name: &str) -> Result<VmConfig> {
        let split = |s: &str, what: &str| {
            shlex::split(s).with_context(|| format!("cannot parse --{what}: unbalanced quotes"))
        };
        Ok(VmConfig {
            name: name.to_string(),
            smp: self.smp,
            queues: self.queues,
            memory_mib: self.memory,
            aio: self.aio,
            cache: self.cache.clone(),
            format: self.format,
            iothread: self.iothread,
            blkdebug: self.blkdebug,
            agents: self.agents.unwrap_or(default_agents),
            guest_json: !self.guest_tables_only,
            guest_capture: self.guest_capture,
            decode_capture: true,
            host_json: !self.host_always_on,
            guest_args: self.guest_args.clone(),
            host_args: split(&self.host_args, "host-args")?,
            host_env: Vec::new(),
            timeout: self.timeout,
            boot_timeout: self.boot_timeout,
            vsock: self.vsock,
            accel: self.accel,
            console: !self.quiet,
            cid: self.cid,
            qemu_args: split(&self.qemu_args, "qemu-args")?,
            host_attach: self.host_attach,
            post: read_script(self.post.as_deref(), "post")?,
            setup: read_script(self.setup.as_deref(), "setup")?,
            extra_disk_mib: self.extra_disk,
            guest_tools: self.guest_tool.clone(),
            vsock_uds: None,
            guest_kernel: self.guest_kernel.clone(),
            qemu: self.qemu.clone(),
            cpu: self.cpu.clone(),
            pin_vcpus: self.pin_vcpus,
            sample_host_cpu: self.sample_host_cpu,
            guest_bin: None,
            host_bin: None,
            insn_count: self.insn_count,
            insn_profile: self.insn_profile,
        })
    }
}

/// The text of an optional `--setup`/`--post` script.
fn read_script(p: Option<&std::path::Path>, what: &str) -> Result<Option<String>> {
    p.map(|p| {
        std::fs::read_to_string(p).with_context(|| format!("read {what} script {}", p.display()))
    })
    .transpose()
}

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("viotrace-vm: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn real_main() -> Result<ExitCode> {
    let cli = Cli::parse();
    let (cfg, workload, out) = match cli.cmd {
        Cmd::Attack { socket } => {
            for r in viotrace_vm_tests::attack::all(&socket) {
                println!("{}", serde_json::to_string(&r)?);
            }
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::Compat { results, out } => {
            compat(results, out)?;
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::Prepare { matrix } => {
            prepare(matrix)?;
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::BenchReport { paths } => {
            bench_report(&paths)?;
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::Bench {
            vm,
            rounds,
            runtime,
            conditions,
            json,
            bpf_stats,
            keep_records,
            out,
        } => {
            let lab = interruptible_lab(&vm.guest_kernel)?;
            let cfg = viotrace_vm_tests::bench::BenchConfig {
                rounds,
                runtime_secs: runtime,
                conditions,
                bpf_stats,
                keep_records,
                vm: VmConfig {
                    console: false,
                    guest_json: json,
                    host_json: json,
                    ..vm.config(Agents::None, "viotrace-bench")?
                },
            };
            viotrace_vm_tests::bench::run(&lab, &cfg, &out)?;
            println!("results in {}", out.display());
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::Run { workload, vm, out } => {
            let text = std::fs::read_to_string(&workload)
                .with_context(|| format!("read workload {}", workload.display()))?;
            (vm.config(Agents::None, "viotrace-lab")?, text, out)
        }
        Cmd::Demo { vm, out } => {
            let mut cfg = vm.config(Agents::Both, "viotrace-demo")?;
            if cfg.host_args.is_empty() {
                // Live end-to-end table every 5 s, waterfalls for I/O slower than 20 ms,
                // and a Perfetto trace of the whole run.
                cfg.host_args = ["-i", "5s", "-t", "20ms", "--chrome-trace"]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                cfg.host_args
                    .push(out.join("trace.json").display().to_string());
            }
            (cfg, workloads::DEMO.to_string(), out)
        }
    };
    let lab = interruptible_lab(&cfg.guest_kernel)?;
    let r = lab.run(&cfg, &workload, &out)?;
    if lab.interrupt_flag().load(Ordering::SeqCst) {
        anyhow::bail!("interrupted");
    }
    print!(
        "{}",
        std::fs::read_to_string(r.path("summary.txt")).unwrap_or_default()
    );
    println!("results in {}", r.out_dir.display());
    Ok(ExitCode::from(u8::try_from(r.workload_rc).unwrap_or(1)))
}

/// The lab for guest kernel `kernel`, with SIGINT and SIGTERM raising its
/// interrupt flag (a run or bench stops its VM and returns).
fn interruptible_lab(kernel: &GuestKernel) -> Result<Lab> {
    let lab = Lab::with_kernel(kernel)?;
    let flag = lab.interrupt_flag();
    signal_hook::flag::register(signal_hook::consts::SIGINT, flag.clone())?;
    signal_hook::flag::register(signal_hook::consts::SIGTERM, flag)?;
    Ok(lab)
}

/// `prepare`: the lab's assets (with `matrix`, every guest kernel and QEMU
/// build of the compatibility matrix, and the fleet tests' servers).
fn prepare(matrix: bool) -> Result<()> {
    let lab = Lab::new()?;
    viotrace_vm_tests::assets::install_vhost_vsock(&lab.assets.cache)?;
    if matrix {
        for k in &GuestKernel::SERIES {
            let g = lab.guest(k)?;
            println!("guest kernel {k}: {}", g.kernel.release);
        }
        for b in &QemuBuild::BUILDS {
            let q = lab.qemu(b)?;
            println!("QEMU {b}: {}", q.version);
        }
        let p = viotrace_vm_tests::assets::prometheus::ensure_prometheus(&lab.assets.cache)?;
        println!("Prometheus (fleet-output tests): {}", p.display());
        let v = viotrace_vm_tests::assets::prometheus::ensure_victoria_metrics(&lab.assets.cache)?;
        println!("VictoriaMetrics (OTLP tests): {}", v.display());
    }
    println!("lab assets ready in {}", lab.assets.cache.display());
    Ok(())
}

/// `bench-report`: one bench run's tables and checks again, or several runs'
/// rounds pooled.
fn bench_report(paths: &[PathBuf]) -> Result<()> {
    let mut runs = Vec::new();
    for path in paths {
        let file = if path.is_dir() {
            path.join("bench.json")
        } else {
            path.clone()
        };
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        runs.push((file.display().to_string(), text));
    }
    let viotrace_vm_tests::bench::Pooled {
        result: res,
        left_out,
        lab,
    } = viotrace_vm_tests::bench::pool(&runs)?;
    // (`render` names it from a typed config, which `bench.json` is not read back into)
    if let Some(lab) = lab {
        println!("lab: {lab}\n");
    }
    if runs.len() > 1 {
        let names: Vec<&str> = runs.iter().map(|(n, _)| n.as_str()).collect();
        println!(
            "pooled: the rounds of {} runs ({})",
            runs.len(),
            names.join(", ")
        );
        if !left_out.is_empty() {
            println!("left out, not in every run: {}", left_out.join(", "));
        }
        println!();
    }
    print!("{}", viotrace_vm_tests::bench::render(&res));
    Ok(())
}

fn compat(mut results: Vec<PathBuf>, out: Option<PathBuf>) -> Result<()> {
    use viotrace_vm_tests::compat;
    if results.is_empty() {
        results.push(viotrace_vm_tests::assets::workspace_root().join("target/lab-tests"));
    }
    let (runs, skipped) = compat::scan(&results)?;
    for s in &skipped {
        eprintln!("viotrace-vm: skipped {}: {}", s.dir.display(), s.reason);
    }
    anyhow::ensure!(
        !runs.is_empty(),
        "no usable lab runs in {}",
        results
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let md = compat::render(&runs, &skipped);
    match out {
        Some(p) => std::fs::write(&p, md).with_context(|| format!("write {}", p.display()))?,
        None => print!("{md}"),
    }
    Ok(())
}
