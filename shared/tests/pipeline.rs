//! End to end over a real socket: guest sender → host server → join engine,
//! with the clock estimated from real probes between two clocks that are in
//! fact the same (this machine's CLOCK_MONOTONIC), so the true offset is 0.
#![cfg(feature = "host")]

use std::time::Duration;

use viotrace_shared::clock::monotonic_ns;
use viotrace_shared::join::synth::{generate, SynthConfig};
use viotrace_shared::join::JoinEngine;
use viotrace_shared::proto::{BatchReader, GuestRecordRef};
use viotrace_shared::record::{ClockDomain, JoinedIo, Point};
use viotrace_shared::transport::host::{serve, ClockSample, Event, EventKind, HostConfig, Listen};
use viotrace_shared::transport::{
    hybrid_vsock_path, local_hello, Endpoint, GuestSender, GuestSenderConfig,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_records_cross_the_socket_and_join_with_a_measured_clock() {
    let uds = std::env::temp_dir().join(format!("viotrace-it-{}.sock", std::process::id()));
    let path = hybrid_vsock_path(&uds, 5515);
    let cfg = HostConfig {
        listens: vec![Listen::Unix {
            path: path.clone(),
            vm: "vm-it".into(),
        }],
        probe_interval: Duration::from_millis(10),
        ..HostConfig::default()
    };
    let (server, mut inbox) = serve(cfg).await.unwrap();

    // Records timed shortly after now, with the true offset 0 and no drift.
    let s = generate(&SynthConfig {
        vm: "vm-it".into(),
        requests: 2000,
        theta_ns: 0,
        drift_ppm: 0.0,
        probe_every_ns: 0,
        start_ns: monotonic_ns() + 300_000_000,
        ..SynthConfig::default()
    });
    let mut gcfg = GuestSenderConfig::new(Endpoint::Unix(path.clone()), local_hello("it", None));
    gcfg.flush_interval = Duration::from_millis(5);
    gcfg.probe_interval = Duration::from_millis(10);
    let sender = GuestSender::start(gcfg).unwrap();

    let mut engine = JoinEngine::default();
    let mut out = Vec::new();
    // Host records come from the host's own tracer: feed them directly.
    for h in s.host.iter().cloned() {
        engine.push_host(h, &mut out);
    }
    let mut samples = 0;
    let mut received = 0;
    let mut sent = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while received < s.guest.len() {
        // Send the guest records once the clock has a few samples.
        if !sent && samples >= 10 {
            for g in &s.guest {
                sender.send_rq(g);
            }
            sent = true;
        }
        assert!(tokio::time::Instant::now() < deadline, "events in time");
        let mut evs = Vec::new();
        inbox.drain(Duration::from_millis(20), |e| evs.push(e));
        if evs.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for ev in evs {
            assert_eq!(ev.vm, "vm-it");
            match &ev.kind {
                EventKind::Clock(_) => samples += 1,
                EventKind::Records { batch, .. } => received += batch.len(),
                EventKind::Disconnected { reason, .. } => panic!("disconnected: {reason}"),
                _ => {}
            }
            feed(&mut engine, ev, &mut out);
        }
    }
    engine.flush(&mut out);
    let st = tokio::task::spawn_blocking(move || sender.shutdown("done", Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!((st.acked, st.lost()), (2000, 0));
    server.shutdown(Duration::from_secs(2)).await;
    let _ = std::fs::remove_file(&path);

    assert_eq!(out.len(), 2000);
    assert!(out
        .iter()
        .all(|j| j.joined && j.ts_domain == ClockDomain::Host));
    let mut worst = 0u64;
    for j in &out {
        let g = &s.guest[j.pid.unwrap() as usize];
        assert_eq!(j.sector, g.sector);
        let truth = g.ts.get(Point::RqIssue).unwrap(); // offset 0: host time == guest time
        let mapped = j.ts.get(Point::RqIssue).unwrap();
        let u = j.clock_uncertainty_ns.unwrap();
        assert!(
            mapped.abs_diff(truth) <= u,
            "mapped {mapped} truth {truth} ± {u}"
        );
        worst = worst.max(u);
    }
    eprintln!("{samples} clock samples; worst stated uncertainty {worst} ns");
}

/// What the host agent does with guest events (clock samples and requests to the join).
fn feed(engine: &mut JoinEngine, ev: Event, out: &mut Vec<JoinedIo>) {
    match ev.kind {
        EventKind::Records { batch, .. } => {
            // As the host agent reads them: in place, one record at a time.
            BatchReader::new().read(&batch, |r| {
                if let Ok(GuestRecordRef::Rq(rq)) = r {
                    engine.push_guest_ref(&ev.vm, rq, out);
                }
            });
        }
        EventKind::Clock(ClockSample::GuestInitiated { t1, t2, t3, t4 }) => {
            let _ = engine.clock(&ev.vm).add_guest_probe(t1, t2, t3, t4);
        }
        EventKind::Clock(ClockSample::HostInitiated { h1, g2, g3, h4 }) => {
            let _ = engine.clock(&ev.vm).add_host_probe(h1, g2, g3, h4);
        }
        _ => {}
    }
}
