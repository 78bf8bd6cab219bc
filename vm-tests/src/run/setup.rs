//! A run's set-up: its initramfs, disks, vsock channel (vhost-user backend or
//! kernel vhost-vsock) and QEMU's command line.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::Run;
use crate::assets::{self, Cpio, GuestAssets, Qemu};
use crate::config::{Agents, DiskFormat, VmConfig, VsockMode};
use crate::proc::Guarded;
use crate::vm::{kernel_cid, kernel_vhost_vsock_usable, tail};

/// The guest↔host channel of a run.
pub(super) struct Vsock {
    pub mode: VsockMode,
    /// Hybrid vsock: the VMM-side Unix socket (`<uds>_<port>` for guest connections).
    pub uds: PathBuf,
    pub vhost_sock: PathBuf,
    pub backend: Option<Guarded>,
}

impl Run<'_> {
    /// The run's initramfs: the guest's base, the tools overlay, and the run's
    /// configuration, setup and workload scripts and guest agent.
    pub(super) fn initrd(
        &self,
        workload: &str,
        guest: &GuestAssets,
        guest_bin: Option<&Path>,
    ) -> Result<PathBuf> {
        let cfg = self.cfg;
        let initrd = self.rd.join("initrd.cpio");
        fs::copy(&guest.base_initramfs, &initrd).context("copy base initramfs")?;
        let mut f = fs::OpenOptions::new().append(true).open(&initrd)?;
        let mut tools = cfg.guest_tools.clone();
        if cfg.insn_count {
            let t = crate::insn::ensure(&self.lab.assets.cache)?;
            tools.push(t.mark.display().to_string());
        }
        if !tools.is_empty() {
            let tools = assets::tools_overlay(&self.lab.assets.cache, &tools)?;
            std::io::copy(&mut File::open(tools)?, &mut f)?;
        }
        let mut c = Cpio::new(Vec::new(), 1_000_000);
        let conf = cfg.guest_config_sh(guest_bin.is_some());
        c.file("viotrace/config.sh", 0o644, conf.as_bytes())?;
        c.file(
            "viotrace/setup.sh",
            0o755,
            cfg.setup.as_deref().unwrap_or("").as_bytes(),
        )?;
        c.file("viotrace/workload.sh", 0o755, workload.as_bytes())?;
        c.file(
            "viotrace/post.sh",
            0o755,
            cfg.post.as_deref().unwrap_or("").as_bytes(),
        )?;
        if let Some(g) = guest_bin {
            c.host_file("bin/viotrace-guest", g)?;
        }
        f.write_all(&c.finish()?)?;
        Ok(initrd)
    }

    /// The data disk, a copy of the golden image in the run's format.
    pub(super) fn data_disk(&self) -> Result<PathBuf> {
        let golden = match self.cfg.format {
            DiskFormat::Raw => &self.lab.assets.golden_raw,
            DiskFormat::Qcow2 => &self.lab.assets.golden_qcow2,
        };
        let disk = self.rd.join(format!("data.{}", self.cfg.format.name()));
        fs::copy(golden, &disk).context("copy golden data disk")?;
        Ok(disk)
    }

    /// The extra blank disk (`--extra-disk`), when asked for.
    pub(super) fn extra_disk(&self, mib: u32) -> Result<PathBuf> {
        let extra = self.rd.join(format!("extra.{}", self.cfg.format.name()));
        if self.cfg.format == DiskFormat::Qcow2 {
            let st = Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2"])
                .arg(&extra)
                .arg(format!("{mib}M"))
                .status()
                .context("run qemu-img")?;
            anyhow::ensure!(st.success(), "qemu-img create failed");
        } else {
            File::create(&extra)?.set_len(u64::from(mib) << 20)?;
        }
        Ok(extra)
    }

    /// The vsock mode, and for vhost-user the backend, started and listening.
    pub(super) fn vsock(&self) -> Result<Vsock> {
        let (cfg, cache) = (self.cfg, &self.lab.assets.cache);
        let mode = match cfg.vsock {
            VsockMode::Auto if kernel_vhost_vsock_usable() => VsockMode::Kernel,
            VsockMode::Auto => {
                if assets::find_vhost_vsock(cache).is_some() {
                    VsockMode::VhostUser
                } else if cfg.agents == Agents::Both {
                    assets::install_vhost_vsock(cache)?;
                    VsockMode::VhostUser
                } else {
                    VsockMode::None
                }
            }
            m => m,
        };
        let uds = cfg
            .vsock_uds
            .clone()
            .unwrap_or_else(|| self.rd.join("vsock.sock"));
        let vhost_sock = self.rd.join("vhost.sock");
        let mut vs = Vsock {
            mode,
            uds,
            vhost_sock,
            backend: None,
        };
        if mode == VsockMode::VhostUser {
            vs.backend = Some(self.vhost_user_backend(&vs)?);
        }
        Ok(vs)
    }

    pub(super) fn vhost_user_backend(&self, vs: &Vsock) -> Result<Guarded> {
        let bin = assets::install_vhost_vsock(&self.lab.assets.cache)?;
        let log_path = self.out.join("vsock-backend.log");
        let log = File::create(&log_path)?;
        let mut b = Guarded::spawn(
            "vhost-device-vsock",
            Command::new(&bin)
                .arg("--vm")
                .arg(format!(
                    "guest-cid={},socket={},uds-path={}",
                    self.cfg.cid,
                    vs.vhost_sock.display(),
                    vs.uds.display()
                ))
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log),
        )?;
        let t = Instant::now();
        while !vs.vhost_sock.exists() {
            if let Some(st) = b.try_wait()? {
                bail!("vhost-device-vsock exited ({st}): {}", tail(&log_path, 10));
            }
            if t.elapsed() > Duration::from_secs(15) {
                bail!(
                    "vhost-device-vsock did not create {}",
                    vs.vhost_sock.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(b)
    }

    /// QEMU's command line, and the accelerator it uses.
    pub(super) fn qemu_command(
        &self,
        qemu_build: &Qemu,
        guest: &GuestAssets,
        initrd: &Path,
        disk: &Path,
        vs: &Vsock,
        paused: bool,
    ) -> Result<(Command, &'static str)> {
        let (cfg, rd) = (self.cfg, self.rd);
        let accel = cfg.accel.resolve();
        // A QEMU in its own root sees only the run directory: the kernel goes there too.
        let vmlinuz = if qemu_build.rooted() {
            let k = rd.join("vmlinuz");
            fs::copy(&guest.kernel.vmlinuz, &k).context("copy the guest kernel")?;
            k
        } else {
            guest.kernel.vmlinuz.clone()
        };
        let mut q = qemu_build.command(&[rd]);
        // As libvirt starts QEMU: named threads (`CPU 0/TCG`, `worker`, ...), which the
        // host agent's interference evidence and the lab's host-threads.txt go by.
        let name = format!("guest={},debug-threads=on", cfg.name);
        q.args(["-name", &name, "-accel", accel, "-nodefaults", "-no-reboot"])
            .args(["-display", "none", "-monitor", "none", "-serial", "stdio"])
            .args(["-cpu", &crate::config::cpu_arg(cfg.cpu.as_deref(), accel)])
            .args(["-smp", &crate::config::smp_arg(cfg.smp, accel)])
            .args(["-m", &format!("{}M", cfg.memory_mib)])
            .arg("-object")
            .arg(format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                cfg.memory_mib
            ))
            .args(["-numa", "node,memdev=mem"])
            .arg("-kernel")
            .arg(&vmlinuz)
            .arg("-initrd")
            .arg(initrd)
            .args([
                "-append",
                "console=ttyS0 panic=-1 quiet loglevel=3 rdinit=/init tsc=reliable \
                     random.trust_cpu=on mitigations=off",
            ])
            .arg("-qmp")
            .arg(format!(
                "unix:{},server=on,wait=off",
                rd.join("qmp.sock").display()
            ));
        if cfg.iothread {
            q.arg("-object")
                .arg(format!("iothread,id={}", VmConfig::IOTHREAD_ID));
        }
        q.args(cfg.disk_args(disk, "data", "vdata"));
        if let Some(mib) = cfg.extra_disk_mib {
            q.args(cfg.disk_args(&self.extra_disk(mib)?, "extra", "vextra"));
        }
        q.args(["-device", "virtio-serial-pci,id=vser"])
            .arg("-chardev")
            .arg(format!(
                "file,id=results,path={}",
                rd.join("results.tar").display()
            ))
            .args([
                "-device",
                "virtserialport,bus=vser.0,chardev=results,name=viotrace.results",
            ]);
        match vs.mode {
            VsockMode::VhostUser => {
                q.arg("-chardev")
                    .arg(format!(
                        "socket,id=vsockchr,path={}",
                        vs.vhost_sock.display()
                    ))
                    .args(["-device", "vhost-user-vsock-pci,chardev=vsockchr"]);
            }
            VsockMode::Kernel => {
                q.arg("-device")
                    .arg(format!("vhost-vsock-pci,guest-cid={}", kernel_cid(cfg.cid)));
            }
            _ => {}
        }
        if paused {
            q.arg("-S");
        }
        if cfg.insn_count {
            if accel != "tcg" {
                bail!("--insn-count needs TCG: QEMU's plugins do not run under {accel}");
            }
            let v = &qemu_build.version;
            if !crate::insn::qemu_loads_plugin(v) || qemu_build.rooted() {
                bail!(
                    "--insn-count: QEMU {v} does not load the instruction-count plugin \
                     (plugin API 1: QEMU before 9.0, the host's own build)"
                );
            }
            let t = crate::insn::ensure(&self.lab.assets.cache)?;
            let mut arg = format!(
                "{},out={}",
                t.plugin.display(),
                self.out.join(crate::insn::MARKS_FILE).display()
            );
            if cfg.insn_profile {
                let p = self.out.join(crate::insn::PROFILE_FILE);
                arg += &format!(",profile={}", p.display());
            }
            q.arg("-plugin").arg(arg);
        }
        q.args(&cfg.qemu_args);
        let qlog = File::create(self.out.join("qemu.log"))?;
        q.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(qlog);
        Ok((q, accel))
    }
}
