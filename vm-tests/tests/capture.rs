//! The guest agent's capture (`--capture`, issue 11's capture mode): every record in compact
//! binary, rendered later to exactly the JSON lines `--json` prints.

use std::collections::BTreeMap;

use viotrace_shared::capture::{CaptureError, CaptureReader, Item};
use viotrace_shared::record::{Record, Stats};
use viotrace_vm_tests::{assets, Agents, RunResult, VmConfig};

mod common;
use common::guest::{counter, totals_rows};
use common::{run_agents, KNOWN_IO};

fn run(name: &str, json: bool) -> RunResult {
    let cfg = VmConfig {
        guest_json: json,
        guest_capture: true,
        guest_args: "-c fio".into(),
        ..VmConfig::default()
    };
    let r = run_agents(name, Agents::Guest, cfg, KNOWN_IO);
    assert_eq!(r.guest_agent_rc, Some(0), "guest agent exit status");
    r
}

fn final_stats(recs: &[Record]) -> &Stats {
    match recs.last() {
        Some(Record::Stats(s)) if s.is_final == Some(true) => s,
        other => panic!("the last line is not the final stats: {other:?}"),
    }
}

/// With `--json` and `--capture` at once, the decoded capture is byte for byte what the agent
/// printed live: every record, in order, and the final stats line; the host's own
/// `viotrace-guest decode` prints the same.
#[test]
fn capture_decodes_to_exactly_the_live_json_lines() {
    let r = run("capture-and-json", true);
    let live = std::fs::read_to_string(r.path("guest.jsonl")).unwrap();
    let decoded = std::fs::read_to_string(r.path("guest.cap.jsonl")).unwrap();
    assert!(
        live == decoded,
        "the decoded capture differs from the live JSON lines"
    );
    let recs = r.records("guest.cap.jsonl").unwrap().0;
    // fio's 600 requests on vdb and its 600 syscalls (-c fio), each with its record.
    let rqs = r.records("guest.cap.jsonl").unwrap();
    let vdb = rqs.guest_rqs().iter().filter(|q| q.disk == "vdb").count();
    assert_eq!(vdb, 600);
    let mut syscalls: BTreeMap<String, usize> = BTreeMap::new();
    for io in rqs.guest_ios() {
        *syscalls.entry(io.syscall.to_string()).or_default() += 1;
    }
    assert_eq!(syscalls.get("pwrite64"), Some(&300), "{syscalls:?}");
    assert!(
        syscalls.get("pread64").is_some_and(|n| *n >= 300),
        "{syscalls:?}"
    );
    // produced = written: every record is in the capture, none lost.
    let st = final_stats(&recs);
    let c = st.counters.as_ref().expect("counters");
    assert_eq!(c.get("capture_records"), Some(&(recs.len() as u64 - 1)));
    assert_eq!(c.get("capture_lost"), Some(&0));
    // The CLI decoder, run on the host.
    let bin = assets::guest_agent_binary().unwrap();
    let out = std::process::Command::new(bin)
        .arg("decode")
        .arg(r.path("guest.cap"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout == decoded.as_bytes(), "decode's output differs");
}

/// Capture alone: the agent's standard output keeps its tables (always-on's human output),
/// and the capture has every syscall's record, where always-on only counts them in the kernel.
#[test]
fn capture_alone_keeps_the_tables_and_records_every_syscall() {
    let r = run("capture-alone", false);
    let log = std::fs::read_to_string(r.path("guest.jsonl")).unwrap();
    let syscalls = totals_rows(&log, "syscalls");
    assert_eq!(syscalls.get("pwrite64"), Some(&300), "{syscalls:?}\n{log}");
    assert_eq!(counter(&log, "io_summarized"), 0, "{log}");
    assert_eq!(counter(&log, "capture_lost"), 0, "{log}");
    let recs = r.records("guest.cap.jsonl").unwrap();
    let written = counter(&log, "capture_records");
    assert_eq!(written, recs.0.len() as u64 - 1, "{log}");
    let ios = recs.guest_ios();
    assert_eq!(
        ios.iter().filter(|io| io.syscall == "pwrite64").count(),
        300
    );
    // The table and the capture count the same syscalls.
    let tabled: u64 = syscalls.values().sum();
    assert_eq!(tabled, ios.len() as u64, "{log}");
    assert_eq!(final_stats(&recs.0).guest_io, Some(tabled));
}

/// A capture that runs out of room (a 32 KiB tmpfs): every record it could not write is
/// counted, the agent says so and fails its exit status, and the file reads back up to the
/// last chunk it wrote whole, then names where it stops.
#[test]
fn a_full_disk_loses_no_record_silently() {
    let cfg = VmConfig {
        guest_json: false,
        guest_args: "-c fio --capture /out/small/guest.cap".into(),
        setup: Some("mkdir -p /out/small && mount -t tmpfs -o size=32k tmpfs /out/small\n".into()),
        ..VmConfig::default()
    };
    let r = run_agents("capture-full", Agents::Guest, cfg, KNOWN_IO);
    let log = std::fs::read_to_string(r.path("guest.jsonl")).unwrap();
    let err = std::fs::read_to_string(r.path("guest.log")).unwrap_or_default();
    assert_ne!(r.guest_agent_rc, Some(0), "{err}");
    assert!(err.contains("No space left on device"), "{err}");
    let (written, lost) = (
        counter(&log, "capture_records"),
        counter(&log, "capture_lost"),
    );
    assert!(written > 0 && lost > 0, "{log}");
    // Every record the kernel emitted was decoded and either written or counted lost.
    assert_eq!(counter(&log, "decode_errors"), 0, "{log}");
    assert_eq!(
        written + lost,
        counter(&log, "rq_emitted") + counter(&log, "io_emitted"),
        "{log}"
    );
    let f = std::fs::File::open(r.path("small/guest.cap")).unwrap();
    let rd = CaptureReader::new(std::io::BufReader::new(f)).unwrap();
    let (mut n, mut end) = (0u64, None);
    for item in rd {
        match item {
            Ok(Item::Record(_)) => n += 1,
            Ok(Item::End(l)) => panic!("a full capture ended cleanly: {l}"),
            Err(e) => end = Some(e),
        }
    }
    assert_eq!(n, written);
    assert!(
        matches!(
            end,
            Some(CaptureError::Truncated { .. } | CaptureError::NoEnd { .. })
        ),
        "{end:?}"
    );
}
