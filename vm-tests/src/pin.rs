//! CPU placement for steadier figures (`VmConfig::pin_vcpus`): each TCG vCPU thread gets a
//! host CPU of its own, the last ones, and everything else the lab starts (QEMU's other
//! threads, the vsock backend, the host agent, the lab itself) the others. A vCPU thread
//! then never waits behind QEMU's I/O threads or an agent on its CPU, nor moves.

use std::fs;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::sched::{sched_setaffinity, CpuSet};
use nix::unistd::Pid;

use crate::qmp::Qmp;

fn set_of(cpus: &[usize]) -> Result<CpuSet> {
    let mut s = CpuSet::new();
    for &c in cpus {
        s.set(c)?;
    }
    Ok(s)
}

/// The split for `vcpus` vCPUs: (the others' CPUs, one CPU per vCPU); at least one CPU
/// must be left for the others.
pub(crate) fn split(cpus: &[usize], vcpus: usize) -> Result<(Vec<usize>, Vec<usize>)> {
    if vcpus == 0 || cpus.len() <= vcpus {
        bail!(
            "cannot pin {vcpus} vCPU(s) apart: {} usable host CPU(s)",
            cpus.len()
        );
    }
    let (rest, own) = cpus.split_at(cpus.len() - vcpus);
    Ok((rest.to_vec(), own.to_vec()))
}

/// Before the run's processes start: the calling thread (whose children inherit it) goes
/// to the CPUs the vCPUs leave.
pub(crate) fn keep_off_vcpu_cpus(vcpus: usize) -> Result<()> {
    let (rest, _) = split(&online_cpus()?, vcpus)?;
    sched_setaffinity(Pid::from_raw(0), &set_of(&rest)?).context("sched_setaffinity (lab)")
}

/// Once QEMU runs: each vCPU thread (QMP `query-cpus-fast`) to its own CPU. Returns the
/// placement, for the run's `pin.txt`.
pub(crate) fn pin_vcpu_threads(qmp_sock: &Path, vcpus: usize) -> Result<String> {
    let (rest, own) = split(&online_cpus()?, vcpus)?;
    let mut q = Qmp::connect(qmp_sock, Duration::from_secs(30))?;
    let cpus = q.execute("query-cpus-fast")?;
    let tids: Vec<i32> = cpus
        .as_array()
        .context("query-cpus-fast: not a list")?
        .iter()
        .filter_map(|c| c["thread-id"].as_i64())
        .map(|t| t as i32)
        .collect();
    if tids.len() != vcpus {
        bail!(
            "query-cpus-fast lists {} vCPU threads, {vcpus} expected",
            tids.len()
        );
    }
    let mut text = format!("others on CPUs {rest:?}\n");
    for (tid, cpu) in tids.iter().zip(&own) {
        sched_setaffinity(Pid::from_raw(*tid), &set_of(&[*cpu])?)
            .with_context(|| format!("sched_setaffinity (vCPU thread {tid})"))?;
        text += &format!("vCPU thread {tid} on CPU {cpu}\n");
    }
    Ok(text)
}

/// Every online CPU (not this thread's affinity: the lab narrows its own).
fn online_cpus() -> Result<Vec<usize>> {
    let online = fs::read_to_string("/sys/devices/system/cpu/online").context("online CPUs")?;
    parse_cpu_list(online.trim())
}

/// A kernel CPU list: `0-3,6,8-9`.
pub(crate) fn parse_cpu_list(s: &str) -> Result<Vec<usize>> {
    let mut v = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => v.extend(a.parse::<usize>()?..=b.parse::<usize>()?),
            None => v.push(part.parse()?),
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_and_splits() {
        assert_eq!(parse_cpu_list("0-3,6,8-9").unwrap(), [0, 1, 2, 3, 6, 8, 9]);
        assert_eq!(parse_cpu_list("0").unwrap(), [0]);
        assert!(parse_cpu_list("x").is_err());
        let (rest, own) = split(&[0, 1], 1).unwrap();
        assert_eq!((rest, own), (vec![0], vec![1]));
        let (rest, own) = split(&[0, 1, 2, 3], 2).unwrap();
        assert_eq!((rest, own), (vec![0, 1], vec![2, 3]));
        assert!(split(&[0, 1], 2).is_err());
        assert!(split(&[0], 1).is_err());
    }
}
