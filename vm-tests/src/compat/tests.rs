use std::fs;
use std::path::Path;

use super::*;

fn summary_json(kernel: &str, qemu: &str, rc: i32, guest_args: &str) -> String {
    serde_json::json!({
        "workload_rc": rc,
        "kernel_release": kernel,
        "qemu_version": qemu,
        "guest_agent_rc": 0,
        "host_agent_rc": 0,
        "config": { "guest_args": guest_args, "qemu": "7.2", "agents": "both" },
    })
    .to_string()
}

fn write(dir: &Path, name: &str, text: &str) {
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join(name), text).unwrap();
}

const GUEST_TP: &str = concat!(
    r#"{"kind":"guest_rq","disk":"vdb"}"#,
    "\n",
    r#"{"kind":"guest_rq","disk":"vdb"}"#,
    "\n",
    r#"{"kind":"guest_rq","disk":"vda"}"#,
    "\n",
    r#"{"kind":"stats","final":true,"mode":"tracepoint","guest_rq":3,"blind_points":["g.kick","g.irq"]}"#,
    "\n"
);

/// A joined run on 6.1 × 7.2.22: 1 of 2 vdb requests joined, 3 lost in transit.
fn joined_run(dir: &Path) {
    write(dir, "summary.txt", "workload exit status: 0\n");
    write(
        dir,
        "summary.json",
        &summary_json("6.1.0-56-cloud-amd64", "7.2.22", 0, "--mode tracepoint"),
    );
    write(dir, "guest.jsonl", GUEST_TP);
    write(
        dir,
        "host.jsonl",
        concat!(
            r#"{"kind":"host_elem"}"#,
            "\n",
            r#"{"kind":"host_elem"}"#,
            "\n",
            r#"{"kind":"stats","transport":[{"balanced":false,"lost_in_transit":3}]}"#,
            "\n"
        ),
    );
    write(
        dir,
        "joined.jsonl",
        concat!(
            r#"{"kind":"io","disk":"vdb","joined":true}"#,
            "\n",
            r#"{"kind":"io","disk":"vdb","joined":false}"#,
            "\n",
            r#"{"kind":"io","disk":null,"joined":false}"#,
            "\n"
        ),
    );
    write(
        dir,
        "guest.log",
        "viotrace-guest: uplink: offered=3 = acked=2 + refused_buffer_full=1 (NOT balanced)\n",
    );
}

#[test]
fn reads_a_joined_run() {
    let t = tempfile::tempdir().unwrap();
    joined_run(t.path());
    let r = read_run(t.path()).unwrap();
    assert_eq!(r.kernel, "6.1.0-56-cloud-amd64");
    assert_eq!(r.qemu, "7.2.22");
    assert!(r.workload_ok);
    let g = r.guest.unwrap();
    assert_eq!(
        (g.requested.as_str(), g.attached.as_str()),
        ("tracepoint", "tracepoint")
    );
    assert_eq!(g.blind_points, ["g.kick", "g.irq"]);
    assert_eq!(r.host_elems, 2);
    assert_eq!(r.joined, Some((1, 2)));
    assert_eq!(r.transport, Some((false, 3)));
    assert_eq!(r.uplink_balanced, Some(false));
}

/// An older run: no summary.json, QEMU only on the host agent's attach line, guest tables only.
#[test]
fn reads_text_only_run() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write(
        d,
        "summary.txt",
        "workload exit status: 0\nguest kernel: 5.10.0-46-cloud-amd64\n\
         agents: Both, guest agent exit 0, host agent exit 0\n",
    );
    write(
        d,
        "host.log",
        "viotrace-host: tracing pid 7 vm=a exe=/usr/bin/qemu (QEMU 10.0.2; layout of QEMU 10.0)\n",
    );
    write(
        d,
        "guest.log",
        "viotrace-guest: kprobe mode on Linux 5.10.0-46-cloud-amd64, attached in 1s\n\
         viotrace-guest: kprobe mode blind points: none\n\
         === viotrace-guest totals (kprobe mode, 2.8s, 650 requests, 828 syscalls) ===\n\
         viotrace-guest: uplink: offered=5 = acked=5 + refused_buffer_full=0 (balanced)\n",
    );
    let r = read_run(d).unwrap();
    assert_eq!(
        (r.kernel.as_str(), r.qemu.as_str()),
        ("5.10.0-46-cloud-amd64", "10.0.2")
    );
    let g = r.guest.unwrap();
    assert_eq!(
        (g.requested.as_str(), g.attached.as_str()),
        ("auto", "kprobe")
    );
    assert!(g.blind_points.is_empty());
    assert_eq!(
        (r.host_elems, r.joined, r.uplink_balanced),
        (0, None, Some(true))
    );
}

#[test]
fn unrecorded_versions_and_failed_runs_are_skipped_not_guessed() {
    let t = tempfile::tempdir().unwrap();
    // The directory name says 6.12 × 11.x, but nothing inside records the QEMU version.
    let a = t.path().join("matrix-6.12-q11");
    write(
        &a,
        "summary.txt",
        "workload exit status: 0\nguest kernel: 6.12.1\n",
    );
    let b = t.path().join("crashed");
    write(&b, "summary.txt", "FAILED: QEMU did not start\n");
    write(&t.path().join("not-a-run"), "host.log", "");
    let (runs, skipped) = scan(&[t.path().to_path_buf()]).unwrap();
    assert!(runs.is_empty());
    assert_eq!(skipped.len(), 2);
    assert!(skipped
        .iter()
        .any(|s| s.reason.contains("QEMU version is not recorded")));
    assert!(skipped.iter().any(|s| s.reason.contains("run failed")));
    assert!(render(&runs, &skipped).contains("2 run director(ies) skipped"));
}

#[test]
fn renders_cells_only_from_successful_runs() {
    let t = tempfile::tempdir().unwrap();
    joined_run(&t.path().join("tp"));
    // auto mode on 5.10 × 7.2.22 that attached with fentry, nested one level deeper.
    let auto = t.path().join("group/auto");
    write(&auto, "summary.txt", "x\n");
    write(
        &auto,
        "summary.json",
        &summary_json("5.10.0-46-cloud-amd64", "7.2.22", 0, ""),
    );
    write(
        &auto,
        "guest.jsonl",
        r#"{"kind":"stats","final":true,"mode":"fentry","guest_rq":1,"blind_points":[]}"#,
    );
    // A failed workload on 6.1 × 10.0.2 proves nothing.
    let bad = t.path().join("bad");
    write(&bad, "summary.txt", "x\n");
    write(
        &bad,
        "summary.json",
        &summary_json("6.1.0-56-cloud-amd64", "10.0.2", 1, ""),
    );
    write(&bad, "guest.jsonl", GUEST_TP);
    let (runs, skipped) = scan(&[t.path().to_path_buf()]).unwrap();
    assert_eq!((runs.len(), skipped.len()), (3, 0));
    let md = render(&runs, &skipped);
    let lines: Vec<_> = md.lines().collect();
    assert_eq!(
        lines[0],
        "| guest kernel | QEMU 7.2.22 (`--qemu 7.2`) | QEMU 10.0.2 (`--qemu 7.2`) |"
    );
    assert_eq!(
        lines[2],
        "| 5.10.0-46-cloud-amd64 | auto→fentry ✓ | not run |"
    );
    assert_eq!(
        lines[3],
        "| 6.1.0-56-cloud-amd64 | tracepoint ✓ (blind: g.kick g.irq) · host ✓ (1 run(s)) · \
         joined 50 % (1/2) · 3 lost, transport NOT balanced in 1 run(s) · \
         guest uplink NOT balanced in 1 run(s) | no successful run · 1 run(s) failed |"
    );
    assert!(md.contains("3 lab run(s), finished between 20"));
}

#[test]
fn a_guest_agent_that_traced_nothing_proves_no_mode() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write(d, "summary.txt", "x\n");
    write(
        d,
        "summary.json",
        &summary_json("6.1", "7.2.22", 0, "--mode=kprobe"),
    );
    write(
        d,
        "guest.jsonl",
        r#"{"kind":"stats","final":true,"mode":"kprobe","guest_rq":0,"blind_points":[]}"#,
    );
    let r = read_run(d).unwrap();
    assert_eq!(r.guest, None);
    assert_eq!(requested_mode("--foo 'a b' --mode=kprobe"), "kprobe");
    assert_eq!(requested_mode("--mode tracepoint -v"), "tracepoint");
}

#[test]
fn bad_json_is_an_error_naming_the_line() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    write(d, "summary.txt", "x\n");
    write(d, "summary.json", &summary_json("6.1", "7.2.22", 0, ""));
    write(d, "guest.jsonl", "{\"kind\":\"stats\"}\nnot json\n");
    let e = read_run(d).unwrap_err();
    assert!(
        format!("{e:#}").contains("guest.jsonl:2: bad JSON"),
        "{e:#}"
    );
}

#[test]
fn no_link_means_no_join_figure_and_runs_without_agents_prove_nothing() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("nolink");
    joined_run(&a);
    let txt = "workload exit status: 0\nvm: 1 vCPU, aio=threads, accel=tcg, vsock=None\n";
    write(&a, "summary.txt", txt);
    let r = read_run(&a).unwrap();
    assert_eq!(r.joined, None);
    assert_eq!(r.host_elems, 2);
    // A deliberately failing workload with no agents: not a viotrace failure.
    let b = t.path().join("cli");
    write(
        &b,
        "summary.txt",
        "workload exit status: 3\nguest kernel: 6.1.0-56-cloud-amd64\n\
         qemu: 7.2.22 (7.2)\nagents: None\n",
    );
    let r = read_run(&b).unwrap();
    assert_eq!((r.agents, r.workload_ok), (false, false));
    assert_eq!(r.qemu_build.as_deref(), Some("7.2"));
    let md = render(&[r], &[]);
    assert!(
        md.contains("| 6.1.0-56-cloud-amd64 | no successful run |"),
        "{md}"
    );
}

#[test]
fn joined_figures_of_several_runs_show_the_range_and_the_newest() {
    let t = tempfile::tempdir().unwrap();
    let base = read_run(&{
        joined_run(t.path());
        t.path().to_path_buf()
    })
    .unwrap();
    let at = |secs| Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs));
    let old = RunFacts {
        joined: Some((416, 650)),
        finished: at(100),
        ..base.clone()
    };
    let new = RunFacts {
        joined: Some((650, 650)),
        finished: at(200),
        ..base
    };
    let md = render(&[new.clone(), old], &[]);
    assert!(
        md.contains("joined 64–100 % over 2 runs (newest 100 %, 650/650)"),
        "{md}"
    );
    let md = render(&[new.clone(), new], &[]);
    assert!(md.contains("joined 100 % (650/650, 2 runs)"), "{md}");
}

#[test]
fn an_agent_restart_counts_every_incarnation() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    joined_run(d);
    // The second guest agent: one more vdb request, joined by the second host agent.
    write(d, "guest.2.jsonl", r#"{"kind":"guest_rq","disk":"vdb"}"#);
    write(
        d,
        "joined.1.jsonl",
        r#"{"kind":"io","disk":"vdb","joined":true}"#,
    );
    // Not an incarnation: must not be counted.
    write(d, "guest.old.jsonl", r#"{"kind":"guest_rq","disk":"vdb"}"#);
    assert_eq!(read_run(d).unwrap().joined, Some((2, 3)));
}

#[test]
fn the_host_kernels_of_the_runs_are_named_with_those_that_recorded_none() {
    let t = tempfile::tempdir().unwrap();
    let a = t.path().join("new");
    joined_run(&a);
    let mut j: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(a.join("summary.json")).unwrap()).unwrap();
    j["host_kernel"] = "6.18.44-fc-v1252".into();
    write(&a, "summary.json", &j.to_string());
    let new = read_run(&a).unwrap();
    assert_eq!(new.host_kernel.as_deref(), Some("6.18.44-fc-v1252"));
    let b = t.path().join("old");
    joined_run(&b);
    let old = read_run(&b).unwrap();
    assert_eq!(old.host_kernel, None);
    let md = render(&[new.clone(), new.clone(), old.clone()], &[]);
    assert!(
        md.contains(" Host kernel(s): 6.18.44-fc-v1252 (2 run(s)), not recorded (1 run(s)).\n"),
        "{md}"
    );
    // No run recorded one: no line, rather than one that says nothing.
    assert!(!render(&[old], &[]).contains("Host kernel"));
}

/// Always-on runs print tables on stdout (the run's guest.jsonl and host.jsonl hold text):
/// the guest's facts come from its start-up line and totals, and no join figure is made from
/// the host's sample of joined records.
#[test]
fn tables_only_runs_prove_their_attach_mode_and_no_join_ratio() {
    let t = tempfile::tempdir().unwrap();
    let d = t.path();
    joined_run(d);
    write(
        d,
        "guest.log",
        "viotrace-guest: fentry mode on Linux 6.1.0-57-cloud-amd64, attached in 2.40s\n\
         viotrace-guest: fentry mode blind points: none\n",
    );
    write(
        d,
        "guest.jsonl",
        "--- interval ending at 1.1s ---\n  syscalls\n\
         === viotrace-guest totals (fentry mode, 2.4s, 600 requests, 760 syscalls) ===\n",
    );
    write(d, "host.jsonl", "== viotrace-host: totals over 3.0s\n");
    let r = read_run(d).unwrap();
    let g = r.guest.expect("the guest's facts from its text output");
    assert_eq!(g.attached, "fentry");
    assert_eq!((r.joined, r.host_elems, r.transport), (None, 0, None));
    // A JSON file with a bad line later is still an error, not a table.
    write(d, "guest.jsonl", "{\"kind\":\"guest_rq\"}\nnot json\n");
    assert!(read_run(d).unwrap_err().to_string().contains("bad JSON"));
}
