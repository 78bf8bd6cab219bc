use proptest::prelude::*;

use super::*;
use std::borrow::Cow;

const MS: i64 = 1_000_000;

fn st(v: &[(&'static str, i64)]) -> Stages {
    Stages(v.iter().map(|(n, x)| (Cow::Borrowed(*n), *x)).collect())
}

/// A joined request's stages with `extra` ns added to stage `slow`.
fn req(slow: &str, extra: i64) -> (Stages, i64) {
    let mut v = vec![
        ("guest_fs", 20_000),
        ("guest_queue", 10_000),
        ("guest_driver", 10_000),
        ("kick_to_pop", 50_000),
        ("qemu_submit", 20_000),
        ("host_io", 200_000),
        ("qemu_complete", 20_000),
        ("push_to_irq", 60_000),
        ("guest_complete", 20_000),
        ("guest_return", 10_000),
    ];
    for e in v.iter_mut() {
        if e.0 == slow {
            e.1 += extra;
        }
    }
    let s = st(&v);
    let t = s.sum();
    (s, t)
}

fn key() -> ClassKey {
    ClassKey::new("vm1", "vda", Op::Read, 4096)
}

fn warm(e: &mut Engine) {
    for _ in 0..32 {
        let (s, t) = req("", 0);
        assert!(e
            .observe(&key(), &s, &Stages::default(), t, MS, None)
            .is_none());
    }
}

#[test]
fn size_classes() {
    assert_eq!(ClassKey::new("v", "d", Op::Read, 512).size_class, 0);
    assert_eq!(ClassKey::new("v", "d", Op::Read, 4096).size_class, 0);
    assert_eq!(ClassKey::new("v", "d", Op::Read, 4097).size_class, 1);
    assert_eq!(ClassKey::new("v", "d", Op::Read, 65536).size_class, 4);
    assert_eq!(ClassKey::new("v", "d", Op::Read, 0).size_class, 0);
}

#[test]
fn each_stage_maps_to_its_cause() {
    for (stage, kind) in [
        ("host_io", CauseKind::HostDevice),
        ("qemu_submit", CauseKind::QemuQueue),
        ("kick_to_pop", CauseKind::HostNotify),
        ("guest_fs", CauseKind::GuestTask),
        ("guest_complete", CauseKind::GuestCompletion),
        ("push_to_irq", CauseKind::IrqDelivery),
    ] {
        let mut e = Engine::new(16);
        warm(&mut e);
        let (s, t) = req(stage, 30 * MS);
        let c = e
            .observe(&key(), &s, &Stages::default(), t, MS, None)
            .unwrap_or_else(|| panic!("{stage} not flagged"));
        assert_eq!(c.kind, kind, "{stage}");
        assert_eq!(c.stage, stage);
        assert_eq!(c.stage_ns - c.baseline_ns, 30 * MS);
        assert!(
            c.evidence.starts_with(&format!("{stage} +30.0 ms")),
            "{}",
            c.evidence
        );
    }
}

#[test]
fn substage_refines_host_io_into_qemu_queue() {
    // Throttling: the time is in host_io.queue (QEMU, before the system call).
    let mut e = Engine::new(16);
    let sub = |q: i64| st(&[("host_io.queue", q), ("host_io.kernel", 190_000)]);
    for _ in 0..32 {
        let (s, t) = req("", 0);
        e.observe(&key(), &s, &sub(10_000), t, MS, None);
    }
    let (s, t) = req("host_io", 20 * MS);
    let c = e
        .observe(&key(), &s, &sub(10_000 + 20 * MS), t, MS, None)
        .unwrap();
    assert_eq!(c.kind, CauseKind::QemuQueue);
    assert_eq!(c.stage, "host_io.queue");
}

#[test]
fn not_judged_before_a_baseline_or_under_the_threshold() {
    let mut e = Engine::new(16);
    let (s, t) = req("host_io", 30 * MS);
    assert!(e
        .observe(&key(), &s, &Stages::default(), t, MS, None)
        .is_none());
    warm(&mut e);
    // Above the class baseline ×3 but under the absolute threshold.
    let (s, t) = req("host_io", 2 * MS);
    assert!(e
        .observe(&key(), &s, &Stages::default(), t, 10 * MS, None)
        .is_none());
    // Another class has no baseline of its own.
    let k2 = ClassKey::new("vm1", "vda", Op::Write, 4096);
    let (s, t) = req("host_io", 30 * MS);
    assert!(e
        .observe(&k2, &s, &Stages::default(), t, MS, None)
        .is_none());
}

#[test]
fn classes_beyond_the_limit_are_counted() {
    let mut e = Engine::new(1);
    let (s, t) = req("", 0);
    e.observe(&key(), &s, &Stages::default(), t, MS, None);
    let k2 = ClassKey::new("vm2", "vda", Op::Read, 4096);
    assert!(e
        .observe(&k2, &s, &Stages::default(), t, MS, None)
        .is_none());
    assert_eq!(e.classes_refused, 1);
}

#[test]
fn window_median_and_wrap() {
    let mut w = Window::default();
    assert_eq!(w.median(), None);
    for v in [5, 1, 3] {
        w.push(v);
    }
    assert_eq!(w.median(), Some(3));
    for _ in 0..WINDOW {
        w.push(100);
    }
    assert_eq!(w.len(), WINDOW);
    assert_eq!(w.median(), Some(100));
}

#[test]
fn fmt_ns_units() {
    assert_eq!(fmt_ns(38_000_000), "38.0 ms");
    assert_eq!(fmt_ns(412_345), "412 µs");
    assert_eq!(fmt_ns(-900), "-900 ns");
}

proptest! {
    /// A steady workload (jitter within ×2 of its baseline) is never flagged.
    #[test]
    fn steady_jitter_is_never_flagged(jit in proptest::collection::vec(0i64..100_000, 200)) {
        let mut e = Engine::new(4);
        for j in jit {
            let (s, t) = req("host_io", j);
            prop_assert!(e.observe(&key(), &s, &Stages::default(), t, 0, None).is_none());
        }
    }

    /// One stage inflated far over its baseline is named, with its excess.
    #[test]
    fn an_inflated_stage_is_named(idx in 0usize..10, extra in 5 * MS..500 * MS) {
        let names = crate::stages::STAGE_NAMES;
        let mut e = Engine::new(4);
        warm(&mut e);
        let (s, t) = req(names[idx], extra);
        let c = e.observe(&key(), &s, &Stages::default(), t, MS, None).unwrap();
        prop_assert_eq!(c.stage.as_str(), names[idx]);
        prop_assert_eq!(c.stage_ns - c.baseline_ns, extra);
        prop_assert_eq!(Some(c.kind), kind_of_stage(names[idx]));
    }
}

fn joined(slow: &str, extra: i64, subs: &[(&'static str, i64)]) -> JoinedIo {
    let (stages, total) = req(slow, extra);
    let mut j: JoinedIo = serde_json::from_value(serde_json::json!({
        "vm": "vm1", "disk": "vdb", "op": "read", "sector": 8, "bytes": 4096,
        "joined": true, "ts": {}, "ts_domain": "host", "stages": {}, "substages": {},
    }))
    .unwrap();
    j.stages = stages;
    j.substages = st(subs);
    j.total_ns = Some(total);
    j
}

#[test]
fn verdicts_mark_the_slow_record_and_count_the_interval() {
    let mut v = Verdicts::new(MS as u64);
    for _ in 0..32 {
        let mut j = joined(
            "",
            0,
            &[("host_io.queue", 5_000), ("host_io.kernel", 190_000)],
        );
        v.judge(&mut j);
        assert!(j.cause.is_none());
    }
    assert!(v.take_interval("t").is_none(), "nothing slow yet");
    // QEMU held the request 20 ms before its system call (throttling).
    let mut j = joined(
        "host_io",
        20 * MS,
        &[
            ("host_io.queue", 20 * MS + 5_000),
            ("host_io.kernel", 190_000),
        ],
    );
    v.judge(&mut j);
    let c = j.cause.as_ref().expect("judged slow");
    assert_eq!(
        (c.kind, c.stage.as_str()),
        (CauseKind::QemuQueue, "host_io.queue")
    );
    let line = serde_json::to_string(&crate::record::Record::Io(j.clone())).unwrap();
    assert!(
        line.contains(r#""cause":{"kind":"qemu_queue","stage":"host_io.queue""#),
        "{line}"
    );
    // Unjoined records and records under the threshold are not judged.
    let mut u = joined("host_io", 20 * MS, &[]);
    u.joined = false;
    v.judge(&mut u);
    assert!(u.cause.is_none());
    let t = v.take_interval("== causes").expect("one cause");
    assert!(
        t.contains("qemu_queue") && t.contains("host_io.queue"),
        "{t}"
    );
    assert_eq!(v.flagged, 1);
    assert!(
        v.take_interval("again").is_none(),
        "the interval starts afresh"
    );
}

#[test]
fn records_without_a_cause_serialize_as_before() {
    let j = joined("", 0, &[]);
    let line = serde_json::to_string(&crate::record::Record::Io(j)).unwrap();
    assert!(!line.contains("cause"), "{line}");
}

fn cause(kind: CauseKind, stage: &str, stage_ns: i64, baseline_ns: i64) -> Cause {
    Cause {
        kind,
        stage: stage.into(),
        stage_ns,
        baseline_ns,
        total_ns: stage_ns + MS,
        baseline_total_ns: MS,
        evidence: "base".into(),
    }
}

#[test]
fn interference_names_who_when_it_explains_the_excess() {
    use crate::interference::Interference;
    let starved = Interference {
        qemu_wait_ns: Some(6 * MS as u64),
        cpu_holder: Some("pid 7 hog".into()),
        ..Default::default()
    };
    // 6 ms of QEMU waits explain a 10 ms excess inside QEMU …
    let c = refine(
        cause(CauseKind::QemuQueue, "host_io.queue", 11 * MS, MS),
        Some(&starved),
    );
    assert_eq!(c.kind, CauseKind::QemuStarved);
    assert!(
        c.evidence.contains("runnable but not running for 6.0 ms")
            && c.evidence.contains("pid 7 hog")
            && c.evidence.ends_with("; base"),
        "{}",
        c.evidence
    );
    // … not a 20 ms one; a guest stage they explain too (QEMU's big lock).
    let c = refine(
        cause(CauseKind::QemuQueue, "host_io.queue", 21 * MS, MS),
        Some(&starved),
    );
    assert_eq!(
        (c.kind, c.evidence.as_str()),
        (CauseKind::QemuQueue, "base")
    );
    let c = refine(
        cause(CauseKind::GuestQueue, "guest_queue", 11 * MS, MS),
        Some(&starved),
    );
    assert_eq!(c.kind, CauseKind::QemuStarved);
    let c = refine(
        cause(CauseKind::GuestQueue, "guest_queue", 11 * MS, MS),
        Some(&Interference::default()),
    );
    assert_eq!(c.kind, CauseKind::GuestQueue);

    let vcpu = Interference {
        vcpu_wait_ns: Some(3 * MS as u64),
        qemu_wait_ns: Some(MS as u64),
        ..Default::default()
    };
    let c = refine(
        cause(CauseKind::IrqDelivery, "push_to_irq", 5 * MS, MS),
        Some(&vcpu),
    );
    assert_eq!(c.kind, CauseKind::VcpuPreempted);
}

#[test]
fn device_interference_names_the_neighbours_or_the_disk() {
    use crate::interference::{DeviceLoad, Interference};
    let noisy = Interference {
        device: DeviceLoad {
            host_disk: Some("vda (254:0)".into()),
            neighbour_inflight: Some(30),
            neighbour_issued: Some(41),
            neighbour_bytes: Some(41 << 20),
        },
        neighbours: vec!["pid 42 fio 100 %".into()],
        qemu_wait_ns: Some(0),
        ..Default::default()
    };
    let c = refine(
        cause(CauseKind::HostDevice, "host_io.kernel", 5 * MS, MS),
        Some(&noisy),
    );
    assert_eq!(c.kind, CauseKind::NoisyNeighbour);
    assert!(
        c.evidence
            .starts_with("41 other requests (41.0 MiB) on vda (254:0) during it (30 in flight at its issue); top issuers: pid 42 fio 100 %"),
        "{}",
        c.evidence
    );
    // A device stage prefers its neighbours to QEMU's waits elsewhere in the request.
    let both = Interference {
        qemu_wait_ns: Some(4 * MS as u64),
        ..noisy.clone()
    };
    let c = refine(
        cause(CauseKind::HostDevice, "host_io.disk", 5 * MS, MS),
        Some(&both),
    );
    assert_eq!(c.kind, CauseKind::NoisyNeighbour);
    // One large request of a neighbour is enough …
    let big = Interference {
        device: DeviceLoad {
            neighbour_inflight: Some(0),
            neighbour_issued: Some(1),
            neighbour_bytes: Some(1 << 20),
            ..noisy.device.clone()
        },
        ..noisy.clone()
    };
    let c = refine(
        cause(CauseKind::HostDevice, "host_io.kernel", 5 * MS, MS),
        Some(&big),
    );
    assert_eq!(c.kind, CauseKind::NoisyNeighbour);
    // … a quiet device is the disk itself.
    let quiet = Interference {
        device: DeviceLoad {
            neighbour_inflight: Some(0),
            neighbour_issued: Some(1),
            neighbour_bytes: Some(4096),
            ..noisy.device.clone()
        },
        ..noisy
    };
    let c = refine(
        cause(CauseKind::HostDevice, "host_io.kernel", 5 * MS, MS),
        Some(&quiet),
    );
    assert_eq!(c.kind, CauseKind::HostDevice);
    assert_eq!(
        refine(cause(CauseKind::HostDevice, "host_io", 5 * MS, MS), None).kind,
        CauseKind::HostDevice
    );
    // The guest's queues: the VM's own requests on the same queue are the evidence.
    let busy = Interference {
        queue_overlap: Some(31),
        ..Default::default()
    };
    let c = refine(
        cause(CauseKind::GuestQueue, "guest_queue", 5 * MS, MS),
        Some(&busy),
    );
    assert_eq!(c.kind, CauseKind::GuestQueue);
    assert!(
        c.evidence
            .starts_with("31 other requests of the VM on its queue overlapped it; "),
        "{}",
        c.evidence
    );
}
