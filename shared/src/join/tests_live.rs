//! Live-mode behaviour: expiry, caps, stalls, bindings, reboots, deferred choices.

use super::emit::drop_unrelated_notifications;
use super::synth::*;
use super::tests::ambiguous_pair;
use super::*;
use crate::record::{ClockDomain, JoinedIo, Point, Points, UnmatchedReason};

#[test]
fn unmatched_are_emitted_with_reasons() {
    let cfg = SynthConfig {
        requests: 300,
        seed: 6,
        ..SynthConfig::default()
    };
    let mut s = generate(&cfg);
    // Drop host element 10, drop guest request 20, corrupt the sector of host 30.
    let lost_host = s.host[10].clone();
    let lost_guest = s.guest[20].clone();
    s.host[30].sector += 8;
    let mut ev = interleave(&s, 1_000_000, 0, 1);
    ev.retain(|e| match e {
        Event::Host(h) => h != &lost_host,
        Event::Guest(g) => g != &lost_guest,
        _ => true,
    });
    let mut e = JoinEngine::new(JoinConfig {
        timeout_ns: 5_000_000,
        ..JoinConfig::default()
    });
    let mut out = Vec::new();
    for ev in ev {
        match ev {
            Event::Guest(g) => e.push_guest("vm0", g, &mut out),
            Event::Host(h) => e.push_host(h, &mut out),
            Event::Probe(a, b, c, d) => e.clock("vm0").add_guest_probe(a, b, c, d).unwrap(),
        }
    }
    // Emitted by the timeout already, before any flush.
    let reasons: Vec<(Option<u32>, Option<u64>, UnmatchedReason)> = out
        .iter()
        .filter(|j| !j.joined)
        .map(|j| (j.pid, j.sector.into(), j.reason.unwrap()))
        .collect();
    assert!(
        reasons.contains(&(
            Some(10),
            Some(s.guest[10].sector),
            UnmatchedReason::NoHostRecord
        )),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.0.is_none()
            && r.1 == Some(s.host[20].sector)
            && r.2 == UnmatchedReason::NoGuestRecord),
        "{reasons:?}"
    );
    assert!(
        reasons.contains(&(
            Some(30),
            Some(s.guest[30].sector),
            UnmatchedReason::MismatchOpSectorLen
        )),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.0.is_none()
            && r.1 == Some(s.host[30].sector)
            && r.2 == UnmatchedReason::MismatchOpSectorLen),
        "{reasons:?}"
    );
    e.flush(&mut out);
    // Nothing lost: 297 joined + 2 unmatched guests + 2 unmatched hosts.
    assert_eq!(out.len(), 301);
    assert_eq!(out.iter().filter(|j| j.joined).count(), 297);
    let st = e.stats();
    assert_eq!(st.unmatched_guest, 2);
    assert_eq!(st.unmatched_host, 2);
    assert_eq!(st.mismatched, 2);
    // The unmatched guest was mapped to the host clock (the VM is synced).
    let ug = out.iter().find(|j| j.pid == Some(10)).unwrap();
    assert_eq!(ug.ts_domain, ClockDomain::Host);
    assert!(ug.clock_uncertainty_ns.is_some());
    assert!(ug.stages.get("device").is_some(), "{:?}", ug.stages);
    let uh = out
        .iter()
        .find(|j| j.pid.is_none() && j.sector == s.host[20].sector)
        .unwrap();
    assert!(uh.stages.get("host_io").is_some());
}

#[test]
fn memory_is_bounded_with_counted_evictions() {
    let cfg = SynthConfig {
        requests: 1000,
        probe_every_ns: 0,
        ..SynthConfig::default()
    };
    let s = generate(&cfg);
    let mut e = JoinEngine::new(JoinConfig {
        max_pending: 100,
        timeout_ns: u64::MAX / 4,
        ..JoinConfig::default()
    });
    let mut out = Vec::new();
    for h in s.host.iter().cloned() {
        e.push_host(h, &mut out);
        assert!(e.stats().pending_host <= 100);
    }
    assert_eq!(out.len(), 900);
    assert!(out
        .iter()
        .all(|j| j.reason == Some(UnmatchedReason::Evicted)));
    assert_eq!(e.stats().evicted, 900);
    e.flush(&mut out);
    assert_eq!(out.len(), 1000);
}

#[test]
fn a_flooding_vm_evicts_only_its_own_records() {
    let s = generate(&SynthConfig {
        requests: 50,
        probe_every_ns: 0,
        ..SynthConfig::default()
    });
    let mut e = JoinEngine::new(JoinConfig {
        max_pending: 1000,
        max_pending_per_vm: 100,
        timeout_ns: u64::MAX / 4,
        ..JoinConfig::default()
    });
    let mut out = Vec::new();
    for g in s.guest.iter().cloned() {
        e.push_guest("good", g, &mut out);
    }
    // The flood: far more records than its cap, with far-future times.
    for i in 0..5000u64 {
        let mut g = s.guest[(i % 50) as usize].clone();
        g.sector = 1 << 40 | i;
        let pts: Vec<(Point, u64)> = g.ts.iter().collect();
        for (p, t) in pts {
            g.ts.set(p, t + (1 << 50));
        }
        e.push_guest("flood", g, &mut out);
    }
    assert!(
        out.iter().all(|j| j.vm == "flood"),
        "only the flood's records were evicted"
    );
    assert_eq!(out.len(), 4900);
    assert_eq!(e.stats().pending_guest, 150);
    e.flush(&mut out);
    assert_eq!(out.iter().filter(|j| j.vm == "good").count(), 50);
}

#[test]
fn guest_only_vm_expires_by_guest_time() {
    let s = generate(&SynthConfig {
        requests: 200,
        probe_every_ns: 0,
        ..SynthConfig::default()
    });
    let mut e = JoinEngine::new(JoinConfig {
        timeout_ns: 1_000_000,
        ..JoinConfig::default()
    });
    let mut out = Vec::new();
    for g in s.guest.iter().cloned() {
        e.push_guest("vm0", g, &mut out);
    }
    assert!(out.len() > 150, "{}", out.len());
    assert!(out
        .iter()
        .all(|j| j.reason == Some(UnmatchedReason::NoHostRecord)
            && j.ts_domain == ClockDomain::Guest));
}

#[test]
fn advance_expires_in_live_mode() {
    let s = generate(&SynthConfig {
        requests: 50,
        ..SynthConfig::default()
    });
    let mut e = JoinEngine::new(JoinConfig {
        timeout_ns: 1_000_000_000,
        ..JoinConfig::default()
    });
    let mut out = Vec::new();
    for &(a, b, c, d) in &s.probes {
        e.clock("vm0").add_guest_probe(a, b, c, d).unwrap();
    }
    // The guest sent 10 requests; the host saw all 50.
    for g in s.guest.iter().take(10).cloned() {
        e.push_guest("vm0", g, &mut out);
    }
    for h in s.host.iter().cloned() {
        e.push_host(h, &mut out);
    }
    assert_eq!(out.len(), 10);
    let last = s
        .host
        .iter()
        .filter_map(|h| h.ts.get(Point::HostIrq))
        .max()
        .unwrap();
    e.advance(last + 500_000_000, &mut out);
    assert_eq!(out.len(), 10, "not yet");
    e.advance(last + 2_500_000_000, &mut out);
    assert_eq!(out.len(), 50);
    assert!(out[10..]
        .iter()
        .all(|j| j.reason == Some(UnmatchedReason::NoGuestRecord)));
    assert_eq!(e.stats().pending_host, 0);
}

#[test]
fn a_stalled_guest_stream_keeps_host_records_waiting_for_the_resend() {
    let s = generate(&SynthConfig {
        requests: 50,
        ..SynthConfig::default()
    });
    let mut e = JoinEngine::new(JoinConfig {
        timeout_ns: 1_000_000_000,
        ..JoinConfig::default()
    });
    let mut out = Vec::new();
    for &(a, b, c, d) in &s.probes {
        e.clock("vm0").add_guest_probe(a, b, c, d).unwrap();
    }
    for g in s.guest.iter().take(10).cloned() {
        e.push_guest("vm0", g, &mut out);
    }
    for h in s.host.iter().cloned() {
        e.push_host(h, &mut out);
    }
    assert_eq!(out.len(), 10);
    // The guest's connection is down: time passes, nothing expires.
    e.set_guest_stalled("vm0", true);
    let last = s
        .host
        .iter()
        .filter_map(|h| h.ts.get(Point::HostIrq))
        .max()
        .unwrap();
    e.advance(last + 10_000_000_000, &mut out);
    assert_eq!(
        out.len(),
        10,
        "host records wait for the resent guest records"
    );
    // The guest reconnects; until its resent records are recent, time
    // passing still expires nothing.
    e.set_guest_stalled("vm0", false);
    e.advance(last + 11_000_000_000, &mut out);
    assert_eq!(
        out.len(),
        10,
        "host records wait while the guest catches up"
    );
    for g in s.guest.iter().skip(10).cloned() {
        e.push_guest("vm0", g, &mut out);
    }
    assert_eq!(out.len(), 50);
    assert!(out.iter().all(|j| j.joined));
}

/// A stall longer than the timeout (the lab's vsock backend took ~10 s to let a
/// cut connection go): host records that arrived while the guest stream was
/// stalled wait until the resent guest stream reaches their own time, not just
/// until it moved `timeout` past where it stood when they arrived.
#[test]
fn resent_guest_records_join_host_records_older_than_the_timeout() {
    let s = generate(&SynthConfig {
        requests: 60,
        interval_ns: 100_000_000,
        ..SynthConfig::default()
    });
    let mut e = JoinEngine::new(JoinConfig {
        timeout_ns: 1_000_000_000,
        ..JoinConfig::default()
    });
    let mut out = Vec::new();
    for &(a, b, c, d) in &s.probes {
        e.clock("vm0").add_guest_probe(a, b, c, d).unwrap();
    }
    for (g, h) in s.guest.iter().zip(&s.host).take(10) {
        e.push_host(h.clone(), &mut out);
        e.push_guest("vm0", g.clone(), &mut out);
    }
    assert_eq!(out.len(), 10);
    // The connection is cut; the host goes on for 5 s.
    e.set_guest_stalled("vm0", true);
    for h in s.host.iter().skip(10).cloned() {
        e.push_host(h, &mut out);
    }
    assert_eq!(out.len(), 10);
    e.set_guest_stalled("vm0", false);
    // The resend: 5 s of guest records, one at a time.
    for g in s.guest.iter().skip(10).cloned() {
        e.push_guest("vm0", g, &mut out);
    }
    assert_eq!(out.len(), 60, "{:?}", e.stats());
    assert!(out.iter().all(|j| j.joined), "{:?}", e.stats());
}

#[test]
fn learned_disk_device_binding_separates_disks() {
    let s = generate(&SynthConfig {
        requests: 3,
        ..SynthConfig::default()
    });
    let mut e = JoinEngine::default();
    let mut out = Vec::new();
    for &(a, b, c, d) in &s.probes {
        e.clock("vm0").add_guest_probe(a, b, c, d).unwrap();
    }
    // Learn vda ↔ d0 and vdb ↔ d1 from two distinct requests.
    let mut g0 = s.guest[0].clone();
    let mut h0 = s.host[0].clone();
    g0.disk = "vda".into();
    h0.device = "d0".into();
    let mut g1 = s.guest[1].clone();
    let mut h1 = s.host[1].clone();
    g1.disk = "vdb".into();
    h1.device = "d1".into();
    e.push_host(h0, &mut out);
    e.push_guest("vm0", g0, &mut out);
    e.push_host(h1, &mut out);
    e.push_guest("vm0", g1, &mut out);
    assert_eq!(out.iter().filter(|j| j.joined).count(), 2);
    // Now two identical host elements on both devices; the vdb request must
    // take the d1 one.
    let mut g2 = s.guest[2].clone();
    g2.disk = "vdb".into();
    let mut ha = s.host[2].clone();
    ha.device = "d0".into();
    let mut hb = s.host[2].clone();
    hb.device = "d1".into();
    e.push_host(ha, &mut out);
    e.push_host(hb, &mut out);
    e.push_guest("vm0", g2, &mut out);
    let j = out.last().unwrap();
    assert!(j.joined);
    assert_eq!(j.disk.as_deref(), Some("vdb"));
    assert_eq!(j.device.as_deref(), Some("d1"));
}

#[test]
fn reboot_resets_the_clock() {
    let mut e = JoinEngine::default();
    assert!(!e.guest_connected("vm0", "boot-a"));
    e.clock("vm0")
        .add_guest_probe(10, 1_000_010, 1_000_011, 20)
        .unwrap();
    assert!(e.clock("vm0").is_synced());
    // Same boot (a reconnect): the clock is kept.
    assert!(!e.guest_connected("vm0", "boot-a"));
    assert!(e.clock("vm0").is_synced());
    // New boot: reset.
    assert!(e.guest_connected("vm0", "boot-b"));
    assert!(!e.clock("vm0").is_synced());
}

#[test]
fn stale_expiry_entries_are_compacted_when_time_stalls() {
    let s = generate(&SynthConfig {
        requests: 20_000,
        probe_every_ns: 0,
        ..SynthConfig::default()
    });
    let mut e = JoinEngine::new(JoinConfig {
        timeout_ns: u64::MAX / 4,
        ..JoinConfig::default()
    });
    let mut out = Vec::new();
    // Host first then guest, one request at a time: each host waits, then joins.
    for (g, h) in s.guest.iter().zip(&s.host) {
        e.push_host(h.clone(), &mut out);
        e.push_guest("vm0", g.clone(), &mut out);
    }
    assert_eq!(out.len(), 20_000);
    assert!(
        e.sides.host.vm(0).deadlines.len() <= 4096 + 4,
        "{}",
        e.sides.host.vm(0).deadlines.len()
    );
}

/// Live mode without any clock: the deferred choices are made before
/// anything of the VM expires (never emitted unmatched while a partner waits).
#[test]
fn deferred_choice_is_made_before_anything_expires() {
    let s = ambiguous_pair();
    let mut e = JoinEngine::default();
    let mut out = Vec::new();
    e.push_host(s.host[0].clone(), &mut out);
    e.push_host(s.host[1].clone(), &mut out);
    e.push_guest("vm0", s.guest[1].clone(), &mut out);
    e.push_guest("vm0", s.guest[0].clone(), &mut out);
    assert!(out.is_empty(), "both choices wait for a clock");
    assert_eq!(e.vms[0].deferred.len(), 2);
    // The guest side moves on by 10 s (another head), then the host side.
    let mut later = s.guest[1].clone();
    later.head = Some(7);
    later.pid = 99;
    later.ts.shift(10_000_000_000);
    e.push_guest("vm0", later, &mut out);
    assert!(out.is_empty());
    let host_last = s.host[1].ts.iter().map(|p| p.1).max().unwrap();
    e.advance(host_last + 10_000_000_000, &mut out);
    let joined: Vec<&JoinedIo> = out.iter().filter(|j| j.joined).collect();
    assert_eq!(joined.len(), 2, "{out:?}");
    for j in joined {
        let i = j.pid.unwrap() as usize;
        assert_eq!(j.ts.get(Point::HostPop), s.host[i].ts.get(Point::HostPop));
    }
    assert!(out.iter().all(|j| j.joined || j.pid == Some(99)));
    assert!(e.vms[0].deferred.is_empty());
}

#[test]
fn kick_after_pop_and_irq_before_push_are_dropped() {
    let mut ts: Points = [
        (Point::VqAdd, 100),
        (Point::Kick, 500),
        (Point::HostPop, 300),
        (Point::HostPush, 900),
        (Point::Irq, 700),
        (Point::DriverComplete, 1000),
    ]
    .into_iter()
    .collect();
    drop_unrelated_notifications(&mut ts, 50);
    assert_eq!(ts.get(Point::Kick), None);
    assert_eq!(ts.get(Point::Irq), None);
    let bd = stages::derive(&ts);
    assert!(bd.stages.iter().all(|(_, ns)| ns >= 0), "{:?}", bd.stages);
}

#[test]
fn causal_notifications_within_uncertainty_stay() {
    let mut ts: Points = [
        (Point::Kick, 320),
        (Point::HostPop, 300),
        (Point::HostPush, 900),
        (Point::Irq, 880),
    ]
    .into_iter()
    .collect();
    drop_unrelated_notifications(&mut ts, 50);
    assert_eq!(ts.get(Point::Kick), Some(320));
    assert_eq!(ts.get(Point::Irq), Some(880));
}

/// A request added while QEMU drained the ring for an earlier kick (not kicked by
/// the guest), completed by a guest handler already running before the host's
/// next notification: neither host notification is attributed to it, and no
/// stage goes negative (the real case of a lab run: kick_to_pop was -279 µs).
#[test]
fn stale_host_notifications_are_not_this_requests() {
    let mut ts = Points::default();
    for (p, t) in [
        (Point::RqIssue, 4_265_736),
        (Point::VqAdd, 4_275_150),
        (Point::HostNotify, 3_996_075),
        (Point::HostSubmit, 4_691_546),
        (Point::HostIoIssue, 4_766_677),
        (Point::HostIoComplete, 4_838_103),
        (Point::HostPush, 4_878_453),
        (Point::Irq, 5_101_795),
        (Point::HostIrq, 5_850_985),
        (Point::DriverComplete, 5_215_394),
        (Point::RqComplete, 5_218_689),
    ] {
        ts.set(p, t);
    }
    drop_unrelated_notifications(&mut ts, 53_396);
    assert_eq!(ts.get(Point::HostNotify), None);
    assert_eq!(ts.get(Point::HostIrq), None);
    let bd = stages::derive(&ts);
    for (name, ns) in &bd.stages.0 {
        assert!(*ns >= 0, "{name} = {ns}");
    }
    // Within the uncertainty both are kept.
    let mut ts2 = Points::default();
    ts2.set(Point::VqAdd, 1_000);
    ts2.set(Point::HostNotify, 900);
    ts2.set(Point::Irq, 5_000);
    ts2.set(Point::HostIrq, 5_050);
    drop_unrelated_notifications(&mut ts2, 100);
    assert_eq!(ts2.get(Point::HostNotify), Some(900));
    assert_eq!(ts2.get(Point::HostIrq), Some(5_050));
}
