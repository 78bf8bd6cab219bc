//! Reading one lab run directory: the facts [`super::RunFacts`] holds.

use std::fs::{self, File};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

use super::{GuestFacts, RunFacts};

/// Reads the facts of one run directory.
pub fn read_run(dir: &Path) -> Result<RunFacts> {
    let txt = fs::read_to_string(dir.join("summary.txt")).context("read summary.txt")?;
    anyhow::ensure!(
        !txt.starts_with("FAILED"),
        "run failed: {}",
        txt.lines().next().unwrap_or("")
    );
    let json: Value = match fs::read(dir.join("summary.json")) {
        Ok(b) => serde_json::from_slice(&b).context("summary.json: bad JSON")?,
        Err(_) => Value::Null,
    };
    let s = |v: &Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_string);
    let kernel = s(&json["kernel_release"])
        .or_else(|| line_value(&txt, "guest kernel:"))
        .context("the guest kernel release is not recorded")?;
    let qemu = s(&json["qemu_version"])
        .or_else(|| line_value(&txt, "qemu:").and_then(|q| first_word(&q)))
        .or_else(|| qemu_from_host_log(&dir.join("host.log")))
        .context("the QEMU version is not recorded")?;
    let qemu_build = s(&json["config"]["qemu"]).or_else(|| {
        let q = line_value(&txt, "qemu:")?;
        let inner = q.split_once('(')?.1.strip_suffix(')')?;
        Some(inner.to_string())
    });
    let host_kernel = s(&json["host_kernel"]);
    let agents = match s(&json["config"]["agents"]) {
        Some(a) => a != "none",
        None => line_value(&txt, "agents:").is_some_and(|a| !a.starts_with("None")),
    };
    // `vm: …, vsock=None`: the run had no guest↔host link, so nothing could be joined.
    let linked = !txt
        .lines()
        .any(|l| l.starts_with("vm: ") && l.ends_with("vsock=None"));
    let workload_rc = json["workload_rc"]
        .as_i64()
        .or_else(|| line_value(&txt, "workload exit status:").and_then(|v| v.parse().ok()))
        .context("the workload exit status is not recorded")?;
    let agent_ok = |key: &str, text: &str| match json[key].as_i64() {
        Some(rc) => rc == 0,
        None => txt.contains(&format!("{text} exit 0")),
    };
    let requested = requested_mode(json["config"]["guest_args"].as_str().unwrap_or(""));
    let guest = if agent_ok("guest_agent_rc", "guest agent") {
        guest_facts(dir, requested)?
    } else {
        None
    };
    let (host_elems, transport) = if agent_ok("host_agent_rc", "host agent") {
        host_facts(&dir.join("host.jsonl"))?
    } else {
        (0, None)
    };
    // Always-on (no `--json`), the host writes only slow and sampled joined records, and
    // tables instead of JSON lines: no join figure can be made from such a run.
    let joined =
        if linked && dir.join("joined.jsonl").is_file() && is_json_lines(&dir.join("host.jsonl")) {
            joined_ratio(dir)?
        } else {
            None
        };
    let uplink_balanced = fs::read_to_string(dir.join("guest.log"))
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("viotrace-guest: uplink: offered="))
                .map(|l| l.trim_end().ends_with("(balanced)"))
        });
    Ok(RunFacts {
        dir: dir.to_path_buf(),
        kernel,
        qemu,
        qemu_build,
        host_kernel,
        agents,
        workload_ok: workload_rc == 0,
        guest,
        host_elems,
        joined,
        transport,
        uplink_balanced,
        finished: fs::metadata(dir.join("summary.txt"))
            .and_then(|m| m.modified())
            .ok(),
    })
}

fn line_value(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

fn first_word(s: &str) -> Option<String> {
    s.split_whitespace().next().map(str::to_string)
}

/// The version on the host agent's attach line: `… (QEMU 11.1.3; layout …`.
fn qemu_from_host_log(p: &Path) -> Option<String> {
    let log = fs::read_to_string(p).ok()?;
    log.lines()
        .filter(|l| l.starts_with("viotrace-host: tracing pid"))
        .find_map(|l| {
            let rest = &l[l.find("(QEMU ")? + 6..];
            let v: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-')
                .collect();
            (!v.is_empty()).then_some(v)
        })
}

/// `--mode X` / `--mode=X` in the guest agent's arguments; `auto` without one.
pub fn requested_mode(guest_args: &str) -> String {
    let words = shlex::split(guest_args).unwrap_or_default();
    let mut it = words.iter();
    while let Some(w) = it.next() {
        if w == "--mode" {
            if let Some(m) = it.next() {
                return m.clone();
            }
        } else if let Some(m) = w.strip_prefix("--mode=") {
            return m.to_string();
        }
    }
    "auto".to_string()
}

/// Whether `p` starts with a JSON object (an agent's `--json` output, not its tables).
fn is_json_lines(p: &Path) -> bool {
    let Ok(f) = File::open(p) else {
        return false;
    };
    BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .find(|l| !l.trim().is_empty())
        .is_some_and(|l| l.trim_start().starts_with('{'))
}

/// Calls `f` with each JSON line of `p`; no lines for a missing file and for an agent's text
/// output (its tables: a first line that is not a JSON object, as when it ran without
/// `--json`). A JSON file with a bad line later is an error.
fn each_line(p: &Path, mut f: impl FnMut(&Value)) -> Result<()> {
    let file = match File::open(p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("open {}", p.display())),
    };
    if !is_json_lines(p) {
        return Ok(());
    }
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: bad JSON", p.display(), i + 1))?;
        f(&v);
    }
    Ok(())
}

/// The guest agent's attach mode and blind points: its final stats line in guest.jsonl, or
/// (tables-only runs) the lines of guest.log.
fn guest_facts(dir: &Path, requested: String) -> Result<Option<GuestFacts>> {
    let mut last = None;
    each_line(&dir.join("guest.jsonl"), |v| {
        if v["kind"] == "stats" && v["final"] == true {
            last = Some(v.clone());
        }
    })?;
    if let Some(st) = last {
        if st["guest_rq"].as_u64().unwrap_or(0) == 0 {
            return Ok(None);
        }
        let blind = st["blind_points"].as_array().cloned().unwrap_or_default();
        return Ok(Some(GuestFacts {
            requested,
            attached: st["mode"].as_str().unwrap_or("?").to_string(),
            blind_points: blind
                .iter()
                .filter_map(|b| b.as_str().map(str::to_string))
                .collect(),
        }));
    }
    // Tables-only runs: the agent's stderr, and its stdout when that is text (the tables).
    let Ok(mut log) = fs::read_to_string(dir.join("guest.log")) else {
        return Ok(None);
    };
    if !is_json_lines(&dir.join("guest.jsonl")) {
        log += &fs::read_to_string(dir.join("guest.jsonl")).unwrap_or_default();
    }
    let Some(attached) = log.lines().find_map(|l| {
        let rest = l.strip_prefix("viotrace-guest: ")?;
        let (mode, tail) = rest.split_once(" mode on Linux ")?;
        (!tail.is_empty()).then(|| mode.to_string())
    }) else {
        return Ok(None);
    };
    // `=== viotrace-guest totals (fentry mode, 2.8s, 650 requests, …`: it traced requests.
    let traced = log.lines().any(|l| {
        l.starts_with("=== viotrace-guest totals")
            && l.split(", ").any(|w| {
                w.strip_suffix(" requests")
                    .and_then(|n| n.parse::<u64>().ok())
                    .is_some_and(|n| n > 0)
            })
    });
    if !traced {
        return Ok(None);
    }
    let blind_points = log
        .lines()
        .find_map(|l| l.strip_prefix(&format!("viotrace-guest: {attached} mode blind points: ")))
        .map(|b| match b.trim() {
            "none" => Vec::new(),
            b => b.split_whitespace().map(str::to_string).collect(),
        })
        .unwrap_or_default();
    Ok(Some(GuestFacts {
        requested,
        attached,
        blind_points,
    }))
}

/// `host_elem` records and the final stats line's transport accounting.
fn host_facts(p: &Path) -> Result<(u64, Option<(bool, u64)>)> {
    let (mut elems, mut transport) = (0, None);
    each_line(p, |v| {
        if v["kind"] == "host_elem" {
            elems += 1;
        } else if v["kind"] == "stats" {
            if let Some(t) = v["transport"].as_array() {
                let balanced = t.iter().all(|vm| vm["balanced"] == true);
                let lost = t
                    .iter()
                    .map(|vm| vm["lost_in_transit"].as_u64().unwrap_or(0))
                    .sum();
                transport = Some((balanced, lost));
            }
        }
    })?;
    Ok((elems, transport))
}

/// Guest `vdb` requests with a joined record / all guest `vdb` requests, over every agent
/// incarnation of the run (`guest.jsonl`, `guest.2.jsonl`, …; `joined.jsonl`, `joined.1.jsonl`, …).
fn joined_ratio(dir: &Path) -> Result<Option<(u64, u64)>> {
    let mut guest = 0;
    for p in incarnations(dir, "guest")? {
        each_line(&p, |v| {
            if v["kind"] == "guest_rq" && v["disk"] == "vdb" {
                guest += 1;
            }
        })?;
    }
    let mut joined = 0;
    for p in incarnations(dir, "joined")? {
        each_line(&p, |v| {
            if v["kind"] == "io" && v["disk"] == "vdb" && v["joined"] == true {
                joined += 1;
            }
        })?;
    }
    Ok((guest > 0).then_some((joined, guest)))
}

/// `<stem>.jsonl` and `<stem>.<n>.jsonl` in `dir` (an agent restarted by a test leaves one per run).
fn incarnations(dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
    let mut v = Vec::new();
    for e in fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let name = e?.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix(stem)?.strip_suffix(".jsonl"))
        else {
            continue;
        };
        let numbered = rest
            .strip_prefix('.')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if rest.is_empty() || numbered {
            v.push(dir.join(name));
        }
    }
    v.sort();
    Ok(v)
}
