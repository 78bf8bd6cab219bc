//! Pooling the rounds of several bench runs (`viotrace-vm bench-report DIR DIR…`).
//!
//! Under emulation a run's medians move by more than the differences its checks ask
//! about; more rounds narrow them. Runs of the same set-up pooled are one longer run:
//! each condition's rounds from every run, and the checks and their bootstrap intervals
//! over all of them. Only the conditions every run has are pooled (with `none`'s rounds
//! of the same runs): a condition of some runs only would be divided by `none`'s rounds
//! of others. Whether the runs' agents are the same is the caller's to know.

use std::collections::BTreeSet;

use anyhow::{bail, Result};
use serde_json::Value;

use super::BenchResult;

/// Appends `b`'s per-round values to `a`'s: arrays are concatenated, objects merged
/// key by key, anything else kept from `a`.
fn append(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Array(x), Value::Array(y)) => x.extend(y),
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in y {
                match x.get_mut(&k) {
                    Some(old) => append(old, v),
                    None => {
                        x.insert(k, v);
                    }
                }
            }
        }
        _ => {}
    }
}

/// The conditions a run has (its `jobs`' keys).
fn conditions(v: &Value) -> BTreeSet<String> {
    v.get("jobs")
        .and_then(Value::as_object)
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

/// Keeps only the conditions in `keep` (jobs, costs, failed runs).
fn retain(v: &mut Value, keep: &BTreeSet<String>) {
    for key in ["jobs", "costs"] {
        if let Some(o) = v.get_mut(key).and_then(Value::as_object_mut) {
            o.retain(|c, _| keep.contains(c));
        }
    }
    if let Some(a) = v.get_mut("failed_runs").and_then(Value::as_array_mut) {
        a.retain(|f| {
            f.get(0)
                .and_then(Value::as_str)
                .is_some_and(|c| keep.contains(c))
        });
    }
}

/// The lab set-up a run names in its `config.vm` (`None`: it names none), as its
/// report's first line says it: the QEMU build, guest kernel, vCPUs, queues, memory and
/// guest CPU model. A run from before the CPU model was a setting (no `cpu` key) ran on
/// `max`; one with `null` (9e22e48's, which did not name the default) on `max,-erms`;
/// later ones name theirs. Runs pool only when these agree.
pub fn lab_of(v: &Value) -> Option<String> {
    let vm = v.get("config")?.get("vm")?;
    let cpu = match vm.get("cpu") {
        None => "max",
        Some(Value::Null) => "max,-erms",
        Some(c) => c.as_str().unwrap_or("?"),
    };
    let f = |k: &str| match vm.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(x) => x.to_string(),
        None => "?".to_string(),
    };
    let queues = f("queues");
    Some(format!(
        "QEMU {}, guest kernel {}, {} vCPU, {queues} queue{}, {} MiB, guest CPU {cpu}",
        f("qemu"),
        f("guest_kernel"),
        f("smp"),
        if queues == "1" { "" } else { "s" },
        f("memory_mib"),
    ))
}

/// Runs pooled ([`pool`]).
#[derive(Debug)]
pub struct Pooled {
    /// Every run's rounds of the conditions they all have.
    pub result: BenchResult,
    /// The conditions left out (not in every run).
    pub left_out: Vec<String>,
    /// The lab set-up they all ran on ([`lab_of`]; `None`: no run names it).
    pub lab: Option<String>,
}

/// The runs' (name, bench.json text) pooled into one result, with the conditions
/// left out because some run lacks them. Runs on different lab set-ups (`lab_of`) are
/// refused: their ratios are not one population.
pub fn pool(runs: &[(String, String)]) -> Result<Pooled> {
    let mut parsed = Vec::new();
    for (name, text) in runs {
        match serde_json::from_str::<Value>(text) {
            Ok(v) => parsed.push(v),
            Err(e) => bail!("{name} is not a bench.json: {e}"),
        }
    }
    let labs: BTreeSet<String> = parsed.iter().filter_map(lab_of).collect();
    if labs.len() > 1 {
        let l: Vec<String> = labs.into_iter().collect();
        bail!("the runs ran on different lab set-ups: {}", l.join("; "));
    }
    let lab = labs.into_iter().next();
    let sets: Vec<BTreeSet<String>> = parsed.iter().map(conditions).collect();
    let Some(first) = sets.first() else {
        bail!("no run to report");
    };
    let common: BTreeSet<String> = first
        .iter()
        .filter(|c| sets.iter().all(|s| s.contains(*c)))
        .cloned()
        .collect();
    if parsed.len() > 1 && !common.contains("none") {
        bail!("the runs have no conditions in common with `none`: nothing to pool");
    }
    let left_out: BTreeSet<String> = sets
        .iter()
        .flatten()
        .filter(|c| !common.contains(*c))
        .cloned()
        .collect();
    let mut acc: Option<Value> = None;
    for mut v in parsed {
        retain(&mut v, &common);
        match &mut acc {
            None => acc = Some(v),
            Some(a) => append(a, v),
        }
    }
    let v = acc.unwrap_or_default();
    Ok(Pooled {
        result: serde_json::from_value(v)?,
        left_out: left_out.into_iter().collect(),
        lab,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(iops: &[f64], failed: &str) -> String {
        serde_json::json!({
            "config": {"rounds": iops.len()},
            "jobs": {
                "none": {"randread-4k-qd1": {"iops": iops, "ios": [1]}},
                "guest": {"randread-4k-qd1": {"iops": iops}},
            },
            "costs": {"guest": {"guest_bpf_programs": {"rq_issue": [1.5]}, "drops": [0]}},
            "failed_runs": [["guest", 0, failed]],
        })
        .to_string()
    }

    #[test]
    fn rounds_of_runs_with_the_same_conditions_are_concatenated() {
        let Pooled {
            result: p,
            left_out,
            lab,
        } = pool(&[
            ("a".into(), run(&[1.0, 2.0], "x")),
            ("b".into(), run(&[3.0], "y")),
        ])
        .unwrap();
        assert!(left_out.is_empty());
        assert_eq!(lab, None, "the runs name no set-up");
        assert_eq!(p.jobs["none"]["randread-4k-qd1"].iops, [1.0, 2.0, 3.0]);
        assert_eq!(p.jobs["guest"]["randread-4k-qd1"].iops, [1.0, 2.0, 3.0]);
        assert_eq!(p.jobs["none"]["randread-4k-qd1"].ios, [1, 1]);
        assert_eq!(p.costs["guest"].guest_bpf_programs["rq_issue"], [1.5, 1.5]);
        assert_eq!(p.costs["guest"].drops, [0, 0]);
        assert_eq!(p.failed_runs.len(), 2);
        assert_eq!(p.failed_runs[1].2, "y");
    }

    #[test]
    fn only_the_conditions_of_every_run_are_pooled() {
        let mut v: Value = serde_json::from_str(&run(&[5.0], "z")).unwrap();
        v["jobs"]["lean"] = serde_json::json!({"randread-4k-qd1": {"iops": [9.0]}});
        v["costs"]["lean"] = serde_json::json!({"drops": [7]});
        v["failed_runs"] = serde_json::json!([["lean", 0, "w"], ["guest", 1, "v"]]);
        let Pooled {
            result: p,
            left_out,
            ..
        } = pool(&[("a".into(), run(&[1.0], "x")), ("b".into(), v.to_string())]).unwrap();
        assert_eq!(left_out, ["lean"]);
        assert!(!p.jobs.contains_key("lean") && !p.costs.contains_key("lean"));
        assert_eq!(p.jobs["guest"]["randread-4k-qd1"].iops, [1.0, 5.0]);
        let failed: Vec<&str> = p.failed_runs.iter().map(|f| f.2.as_str()).collect();
        assert_eq!(failed, ["x", "v"]);
    }

    #[test]
    fn runs_on_different_lab_set_ups_are_refused() {
        let with_vm = |vm: Value| {
            let mut v: Value = serde_json::from_str(&run(&[1.0], "")).unwrap();
            v["config"]["vm"] = vm;
            v.to_string()
        };
        let vm = |cpu: Option<Value>| {
            let mut v = serde_json::json!({"qemu": "7.2", "guest_kernel": "6.1", "smp": 1});
            if let Some(c) = cpu {
                v["cpu"] = c;
            }
            v
        };
        let old = with_vm(vm(None));
        let default = with_vm(vm(Some(Value::Null)));
        let max = with_vm(vm(Some("max".into())));
        // before the setting, the lab ran on `max`: the same set-up
        let p = pool(&[("a".into(), old.clone()), ("b".into(), max)]).unwrap();
        // (the report's first line: 1 queue, 1024 MiB when the run names them)
        assert_eq!(
            p.lab.as_deref(),
            Some("QEMU 7.2, guest kernel 6.1, 1 vCPU, ? queues, ? MiB, guest CPU max")
        );
        // 9e22e48's runs did not name its default
        let named = with_vm(vm(Some("max,-erms".into())));
        assert!(pool(&[("a".into(), default.clone()), ("b".into(), named)]).is_ok());
        let e = pool(&[("a".into(), old), ("b".into(), default.clone())]).unwrap_err();
        assert!(e.to_string().contains("different lab set-ups"), "{e}");
        let mut q11 = vm(Some(Value::Null));
        q11["qemu"] = "11.x".into();
        assert!(pool(&[("a".into(), default), ("b".into(), with_vm(q11))]).is_err());
    }

    #[test]
    fn runs_without_none_in_common_or_not_json_are_refused() {
        let other = serde_json::json!({"jobs": {"guest": {}}}).to_string();
        let e = pool(&[("a".into(), run(&[1.0], "")), ("b".into(), other)]).unwrap_err();
        assert!(e.to_string().contains("nothing to pool"), "{e}");
        let e = pool(&[("c".into(), "{".into())]).unwrap_err();
        assert!(e.to_string().starts_with("c is not a bench.json"), "{e}");
        assert!(pool(&[]).is_err());
    }
}
