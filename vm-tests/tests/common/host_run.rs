//! The host agent's runs of the lab's known workload, and their checks (shared
//! by the host agent's test files).
#![allow(dead_code)]

use viotrace_shared::record::{Backend, Point};
use viotrace_vm_tests::{Agents, RunResult, VmConfig};

use super::checks::{elems, known_io_device};
use super::run_agents;

/// A run with the host agent alone; its workload and the agent succeeded.
pub fn run_host(name: &str, cfg: VmConfig, workload: &str) -> RunResult {
    let r = run_agents(name, Agents::Host, cfg, workload);
    let log = std::fs::read_to_string(r.path("host.log")).unwrap_or_default();
    assert_eq!(r.workload_rc, 0, "workload failed:\n{}", r.workload_log());
    assert_eq!(
        r.host_agent_rc,
        Some(0),
        "host agent exit status; log:\n{log}"
    );
    assert!(!log.contains("panicked"), "{log}");
    r
}

/// The known workload's records on the host (`check_known_io_kicked`, kicked).
pub fn check_known_io(r: &RunResult, backend: Backend) {
    check_known_io_kicked(r, backend, true)
}

/// `check_known_io`; `kicked`: the guest kicks for each request (an IOThread polls the
/// ring instead, and the guest's kicks stay off while it does: no h.notify then).
pub fn check_known_io_kicked(r: &RunResult, backend: Backend, kicked: bool) {
    let all = elems(r);
    let recs = known_io_device(&all);
    let mut dd = Vec::new();
    for v in &recs {
        assert_eq!(v.backend, backend, "{v:?}");
        assert_eq!(v.queue, 0, "{v:?}");
        assert!(v.head < 256, "{v:?}");
        assert_eq!(v.qemu_pid, r.qemu_pid, "{v:?}");
        let sector = v.sector;
        if v.bytes == 65536 {
            dd.push(sector);
        } else {
            assert!(sector % 8 == 0 && sector * 512 < 32 << 20, "{v:?}");
        }
        // h.pop needs the optional virtqueue_pop uprobe (--pop); h.notify is the kick handling.
        let pop = v.ts.get(Point::HostPop).or(v.ts.get(Point::HostNotify));
        let pop = match (pop, kicked) {
            (Some(t), _) => t,
            (None, false) => v.ts.get(Point::HostSubmit).unwrap_or_default(),
            (None, true) => panic!("h.pop or h.notify: {v:?}"),
        };
        let push =
            v.ts.get(Point::HostPush)
                .unwrap_or_else(|| panic!("h.push: {v:?}"));
        assert!(pop > 0 && pop <= push, "{v:?}");
        // Every request here is a read or a write: h.submit (QEMU's block
        // accounting start by default, the blk_aio_* call with --submit) lies
        // between the kick handling and the host I/O.
        let submit =
            v.ts.get(Point::HostSubmit)
                .unwrap_or_else(|| panic!("h.submit: {v:?}"));
        let io = v.ts.get(Point::HostIoIssue).unwrap_or(push);
        assert!(pop <= submit && submit <= io, "{v:?}");
        for (k, t) in v.ts.iter() {
            assert!(k.name().starts_with("h.") && t > 0, "{v:?}");
        }
    }
    dd.sort();
    assert_eq!(dd, (0..50).map(|i| i * 128).collect::<Vec<u64>>());
}

/// With `--submit` on `aio=threads`: every known-workload record has its host
/// I/O (the worker's pread/pwrite found by the buffer the `blk_aio_*` probe read
/// from the request's QEMUIOVector), so the probe read the vector right.
pub fn check_submit_host_io(r: &RunResult) {
    let all = elems(r);
    let recs = known_io_device(&all);
    assert!(!recs.is_empty());
    for v in recs {
        let issue =
            v.ts.get(Point::HostIoIssue)
                .unwrap_or_else(|| panic!("h.io_issue: {v:?}"));
        let done =
            v.ts.get(Point::HostIoComplete)
                .unwrap_or_else(|| panic!("h.io_complete: {v:?}"));
        assert!(issue <= done, "{v:?}");
    }
}
