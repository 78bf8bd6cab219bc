//! A host agent run by a test itself (several VMs under one agent, test hooks).
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use viotrace_shared::record::Stats;
use viotrace_vm_tests::assets;
use viotrace_vm_tests::records::Records;

/// Starts the host agent with `--json --ready-file`, the extra `args` and `env`,
/// output in `dir` (host.jsonl, host.log), and waits until its probes are attached.
pub fn start(dir: &Path, args: &[String], env: &[(&str, &str)]) -> Child {
    let ready = dir.join("host.ready");
    let mut cmd = Command::new(assets::host_agent_binary().unwrap());
    cmd.arg("--json").arg("--ready-file").arg(&ready).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut host = cmd
        .stdout(std::fs::File::create(dir.join("host.jsonl")).unwrap())
        .stderr(std::fs::File::create(dir.join("host.log")).unwrap())
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !ready.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "host agent not ready"
        );
        assert!(host.try_wait().unwrap().is_none(), "host agent died");
        std::thread::sleep(Duration::from_millis(50));
    }
    host
}

/// SIGINT, then the exit status and how long the agent took to stop.
pub fn stop(host: &mut Child) -> (ExitStatus, Duration) {
    let t = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(host.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let st = host.wait().unwrap();
    (st, t.elapsed())
}

/// The agent's final stats line.
pub fn final_stats(dir: &Path) -> Stats {
    Records::read(&dir.join("host.jsonl"))
        .unwrap()
        .stats()
        .expect("host stats line")
        .clone()
}

/// One VM's transport account in the final stats line.
pub fn account(dir: &Path, vm: &str) -> Value {
    let last = final_stats(dir);
    last.transport
        .as_ref()
        .and_then(|a| a.iter().find(|a| a["vm"] == vm))
        .unwrap_or_else(|| panic!("no transport account for {vm}: {last:?}"))
        .clone()
}
