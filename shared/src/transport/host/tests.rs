use super::*;
use crate::proto::{read_message, write_message, Message};
use crate::transport::faults::{Fault, FaultProxy};
use crate::transport::guest::tests::{fast_cfg, rq, tmp_sock};
use crate::transport::{hybrid_vsock_path, local_hello, Endpoint, GuestSender};
use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

fn unix_cfg(paths: &[(&PathBuf, &str)]) -> HostConfig {
    HostConfig {
        listens: paths
            .iter()
            .map(|(p, vm)| Listen::Unix {
                path: (*p).clone(),
                vm: vm.to_string(),
            })
            .collect(),
        probe_interval: Duration::from_millis(20),
        ..HostConfig::default()
    }
}

/// Drains the inbox into `f` until it returns true (or 20 s pass).
async fn until(inbox: &mut Inbox, mut f: impl FnMut(Event) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = false;
    while !done {
        assert!(Instant::now() < deadline, "timed out waiting for events");
        inbox.drain(Duration::from_millis(50), |e| done |= f(e));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until `want` records have arrived (from any VM).
async fn until_records(inbox: &mut Inbox, want: usize) {
    let mut n = 0;
    until(inbox, |e| {
        if let EventKind::Records { batch, .. } = e.kind {
            n += batch.len();
        }
        n == want
    })
    .await;
}

fn account(server: &Server, vm: &str) -> VmAccount {
    server
        .accounts()
        .into_iter()
        .find(|a| a.vm == vm)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_guests_and_survives_a_bad_one() {
    let p1 = tmp_sock("h1");
    let p2 = hybrid_vsock_path(&tmp_sock("h2"), 5515);
    let (server, mut inbox) = serve(unix_cfg(&[(&p1, "vm-a"), (&p2, "vm-b")]))
        .await
        .unwrap();
    // A bad client first: garbage after a valid hello.
    let bad = {
        let p = p1.clone();
        tokio::task::spawn_blocking(move || {
            let mut s = UnixStream::connect(&p).unwrap();
            write_message(&mut s, &Message::Hello(local_hello("bad", None))).unwrap();
            let _ = read_message(&mut s);
            let _ = s.write_all(&u32::MAX.to_le_bytes());
            // The host says why before it closes: the guest need not wait out
            // its silence timeout to reconnect.
            let mut why = None;
            while let Ok(Some(m)) = read_message(&mut s) {
                if let Message::Bye { reason } = m {
                    why = Some(reason);
                }
            }
            why
        })
    };
    let why = bad.await.unwrap().expect("a bye before the close");
    assert!(why.starts_with("connection dropped: "), "{why}");
    let a = GuestSender::start(fast_cfg(Endpoint::Unix(p1.clone()))).unwrap();
    let b = GuestSender::start(fast_cfg(Endpoint::Unix(p2.clone()))).unwrap();
    for i in 0..3000 {
        a.send_rq(&rq(i));
        b.send_rq(&rq(i));
    }
    let mut recs: HashMap<String, usize> = HashMap::new();
    let (mut guest_clock, mut host_clock, mut bad_dropped) = (0, 0, false);
    until(&mut inbox, |e| {
        match e.kind {
            EventKind::Records { batch, .. } => {
                *recs.entry(e.vm.clone()).or_default() += batch.len()
            }
            EventKind::Clock(ClockSample::GuestInitiated { t1, t2, t3, t4 }) => {
                assert!(t4 >= t1 && t3 >= t2);
                guest_clock += 1;
            }
            EventKind::Clock(ClockSample::HostInitiated { h1, g2, g3, h4 }) => {
                assert!(h4 >= h1 && g3 >= g2);
                host_clock += 1;
            }
            EventKind::Disconnected { reason, error, .. } if e.vm == "vm-a" && !bad_dropped => {
                assert!(error, "{reason}");
                assert!(reason.contains("exceeds the maximum"), "{reason}");
                bad_dropped = true;
            }
            _ => {}
        }
        recs.values().sum::<usize>() == 6000 && guest_clock >= 2 && host_clock >= 2
    })
    .await;
    assert!(bad_dropped);
    let st = tokio::task::spawn_blocking(move || a.shutdown("done", Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!((st.acked, st.lost()), (3000, 0));
    let acc = account(&server, "vm-a");
    assert_eq!(
        (acc.produced, acc.delivered, acc.bad_connections),
        (3000, 3000, 1)
    );
    assert!(acc.balanced(), "{acc:?}");
    assert_eq!(acc.clock_rejected, 0);
    server.shutdown(Duration::from_secs(2)).await;
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_errors_timeouts_and_connection_caps_are_counted() {
    let p = tmp_sock("hs");
    let mut cfg = unix_cfg(&[(&p, "v")]);
    cfg.handshake_timeout = Duration::from_millis(200);
    cfg.idle_timeout = Duration::from_millis(400);
    cfg.budget.connect_burst = 4.0;
    cfg.budget.connects_per_sec = 0.01;
    let (server, mut inbox) = serve(cfg).await.unwrap();
    let p2 = p.clone();
    tokio::task::spawn_blocking(move || {
        // Wrong first message.
        let mut s = UnixStream::connect(&p2).unwrap();
        write_message(&mut s, &Message::Bye { reason: "x".into() }).unwrap();
        // Wrong version.
        let mut s2 = UnixStream::connect(&p2).unwrap();
        let mut h = local_hello("v", None);
        h.protocol_version = 99;
        write_message(&mut s2, &Message::Hello(h)).unwrap();
        assert!(matches!(
            read_message(&mut s2).unwrap(),
            Some(Message::Bye { .. })
        ));
        // Silent client: handshake timeout.
        let s3 = UnixStream::connect(&p2).unwrap();
        std::thread::sleep(Duration::from_millis(400));
        // Idle after hello: idle timeout.
        let mut s4 = UnixStream::connect(&p2).unwrap();
        write_message(&mut s4, &Message::Hello(local_hello("v", None))).unwrap();
        std::thread::sleep(Duration::from_millis(900));
        // The connection budget (burst 4) is spent: refused at once.
        let mut s5 = UnixStream::connect(&p2).unwrap();
        let mut b = [0u8; 8];
        assert!(matches!(s5.read(&mut b), Ok(0) | Err(_)));
        drop((s, s3));
    })
    .await
    .unwrap();
    let mut ends = 0;
    until(&mut inbox, |e| {
        if let EventKind::Disconnected { error, .. } = e.kind {
            assert!(error);
            ends += 1;
        }
        ends == 4
    })
    .await;
    let a = account(&server, "v");
    assert_eq!(a.connections, 4, "{a:?}");
    assert_eq!(a.rejected_connections, 1, "{a:?}");
    assert_eq!((a.handshake_timeouts, a.idle_timeouts), (1, 1), "{a:?}");
    assert_eq!(a.bad_connections, 4, "{a:?}");
}

/// Forged clock samples (host timestamps the host never took, or samples that
/// contradict causality) are refused and counted; genuine ones pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_clock_samples_are_rejected() {
    let p = tmp_sock("clk");
    let mut cfg = unix_cfg(&[(&p, "v")]);
    cfg.probe_interval = Duration::from_secs(3600);
    let (server, mut inbox) = serve(cfg).await.unwrap();
    let p2 = p.clone();
    let raw = tokio::task::spawn_blocking(move || {
        let mut s = UnixStream::connect(&p2).unwrap();
        write_message(&mut s, &Message::Hello(local_hello("v", None))).unwrap();
        assert!(matches!(
            read_message(&mut s),
            Ok(Some(Message::HelloAck(_)))
        ));
        // Made-up host timestamps.
        let forged = Message::ClockSample {
            seq: 1,
            t1: 10,
            t2: 5_000_000,
            t3: 5_000_001,
            t4: 20,
        };
        write_message(&mut s, &forged).unwrap();
        // A real exchange, then a tampered copy, then the true one.
        let t1 = crate::clock::monotonic_ns();
        write_message(&mut s, &Message::ClockProbe { seq: 2, t1 }).unwrap();
        let (t2, t3) = loop {
            if let Some(Message::ClockReply { t2, t3, .. }) = read_message(&mut s).unwrap() {
                break (t2, t3);
            }
        };
        let t4 = crate::clock::monotonic_ns();
        let tampered = Message::ClockSample {
            seq: 2,
            t1,
            t2: t2 + 1_000_000,
            t3,
            t4,
        };
        write_message(&mut s, &tampered).unwrap();
        let good = Message::ClockSample {
            seq: 2,
            t1,
            t2,
            t3,
            t4,
        };
        write_message(&mut s, &good).unwrap();
        // Pong to a ping never sent.
        let pong = Message::ClockPong {
            seq: 77,
            h1: 1,
            g2: 2,
            g3: 3,
        };
        write_message(&mut s, &pong).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        s
    })
    .await
    .unwrap();
    let mut samples = 0;
    until(&mut inbox, |e| {
        if let EventKind::Clock(ClockSample::GuestInitiated { t2, .. }) = e.kind {
            assert!(!(5_000_000..=6_000_000).contains(&t2));
            samples += 1;
        }
        account(&server, "v").clock_rejected == 3
    })
    .await;
    assert_eq!(samples, 1);
    assert_eq!(account(&server, "v").clock_samples, 1);
    drop(raw);
}

/// Every fault of the proxy costs a reconnection or a resend, never a record:
/// each record arrives exactly once and the accounts balance on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_between_guest_and_host_lose_nothing_and_are_counted() {
    let host_path = tmp_sock("fh");
    let proxy_path = tmp_sock("fp");
    let (server, mut inbox) = serve(unix_cfg(&[(&host_path, "vm")])).await.unwrap();
    let faults = vec![
        Fault::DropFrame(4),
        Fault::CutFrame(5),
        Fault::DropBytes(4),
        Fault::DropFrame(6),
        Fault::Stall(3, Duration::from_millis(700)),
    ];
    let px = FaultProxy::start(&proxy_path, &host_path, faults.clone()).unwrap();
    let mut cfg = fast_cfg(Endpoint::Unix(proxy_path.clone()));
    cfg.batch_max = 64;
    let g = GuestSender::start(cfg).unwrap();
    let total = 20_000u64;
    let feeder = tokio::task::spawn_blocking(move || {
        for i in 0..total {
            g.send_rq(&rq(i));
            if i % 500 == 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        g
    });
    let mut seen = BTreeSet::new();
    let mut dups = 0;
    until(&mut inbox, |e| {
        if let EventKind::Records { batch, .. } = e.kind {
            for r in batch.to_records().unwrap() {
                let crate::proto::GuestRecord::Rq(r) = r else {
                    panic!()
                };
                dups += usize::from(!seen.insert(r.pid));
            }
        }
        seen.len() as u64 == total
    })
    .await;
    let g = feeder.await.unwrap();
    let st = tokio::task::spawn_blocking(move || g.shutdown("done", Duration::from_secs(5)))
        .await
        .unwrap();
    assert_eq!(dups, 0, "a record was delivered twice");
    assert_eq!(
        (st.produced, st.acked, st.lost()),
        (total, total, 0),
        "{st:?}"
    );
    assert!(st.resent > 0 && st.connects >= 5, "{st:?}");
    let a = account(&server, "vm");
    assert!(a.balanced(), "{a:?}");
    assert_eq!(
        (a.delivered, a.lost_in_transit, a.in_flight),
        (total, 0, 0),
        "{a:?}"
    );
    assert!(a.resyncs >= 2, "{a:?}");
    assert!(a.bad_connections >= 1, "{a:?}");
    assert_eq!(*px.applied.lock().unwrap(), faults);
}

/// A guest that floods records is held to its budget, in bytes and in
/// records, and cannot delay another VM: the agent's inbox serves connections
/// in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_guest_is_throttled_and_the_other_vm_is_served() {
    let pa = tmp_sock("fa");
    let pb = tmp_sock("fb");
    let mut cfg = unix_cfg(&[(&pa, "flood"), (&pb, "quiet")]);
    cfg.budget.bytes_per_sec = 256.0 * 1024.0;
    cfg.budget.records_pending = 2048;
    let (server, mut inbox) = serve(cfg).await.unwrap();
    let mut fcfg = fast_cfg(Endpoint::Unix(pa.clone()));
    fcfg.max_buffered = 4096;
    let flood = GuestSender::start(fcfg).unwrap();
    let quiet = GuestSender::start(fast_cfg(Endpoint::Unix(pb.clone()))).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let flooder = tokio::task::spawn_blocking(move || {
        let mut i = 0;
        while !s2.load(Ordering::Relaxed) {
            flood.send_rq(&rq(i));
            i += 1;
        }
        flood
    });
    let (mut quiet_n, mut flood_n) = (0usize, 0usize);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(1500) {
        inbox.drain(Duration::from_millis(50), |e| {
            if let EventKind::Records { batch, .. } = e.kind {
                flood_n += batch.len();
            }
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Each record costs at least RECORD_COST: tiny records (about 20 bytes
    // here) get no more through than request records as the agent sends
    // them: over 1.5 s, the bucket's second of burst and 1.5 s of rate, plus
    // one read's overshoot (64 KiB) charged as debt. (At 20 bytes a record,
    // 32 000 would fit in those bytes.)
    let bound = (2.5 * 256.0 * 1024.0) as usize / conn::RECORD_COST + 64 * 1024 / 20;
    let first = flood_n;
    for i in 0..500 {
        quiet.send_rq(&rq(i));
    }
    until(&mut inbox, |e| {
        if let EventKind::Records { batch, .. } = e.kind {
            match e.vm.as_str() {
                "quiet" => quiet_n += batch.len(),
                _ => flood_n += batch.len(),
            }
        }
        quiet_n == 500
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let flood = flooder.await.unwrap();
    // (asserted once the flooder stopped: a runtime waits for its blocking tasks)
    assert!(first <= bound, "{first} records through, at most {bound}");
    let fst = flood.stats();
    // The flood outran its budget: its own buffer refused records (counted).
    assert!(fst.dropped_full > 0, "{fst:?}");
    let a = account(&server, "flood");
    assert!(a.throttled_ms > 0, "{a:?}");
    assert!(a.balanced(), "{a:?}");
    assert!(flood_n > 0);
    drop((flood, quiet));
}

/// An honest guest's records (the BPF layout, each above RECORD_COST) are
/// charged their bytes, once, however their frames are split across reads:
/// within its budget, it is never throttled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_within_its_budget_is_charged_its_bytes_and_not_throttled() {
    use crate::proto::rq_bpf::{KIND_RQ, RECORD_LEN};
    let p = tmp_sock("honest");
    let mut cfg = unix_cfg(&[(&p, "honest")]);
    cfg.budget.bytes_per_sec = 512.0 * 1024.0;
    let (server, mut inbox) = serve(cfg).await.unwrap();
    let g = GuestSender::start(fast_cfg(Endpoint::Unix(p.clone()))).unwrap();
    let mut rec = vec![0u8; RECORD_LEN];
    rec[..4].copy_from_slice(&KIND_RQ.to_le_bytes());
    // About 400 KiB in 2 000 records at once: within the bucket's first second.
    for _ in 0..2000 {
        g.send_rq_bpf(&rec, 0, "vda");
    }
    until_records(&mut inbox, 2000).await;
    let a = account(&server, "honest");
    assert_eq!((a.delivered, a.throttled_ms), (2000, 0), "{a:?}");
    drop(g);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_that_keeps_sending_is_not_idle_and_one_that_stops_is() {
    let p = tmp_sock("idle");
    let mut cfg = unix_cfg(&[(&p, "v")]);
    cfg.idle_timeout = Duration::from_millis(300);
    let (server, mut inbox) = serve(cfg).await.unwrap();
    let p2 = p.clone();
    let ended_after = tokio::task::spawn_blocking(move || {
        let mut s = UnixStream::connect(&p2).unwrap();
        write_message(&mut s, &Message::Hello(local_hello("v", None))).unwrap();
        assert!(matches!(
            read_message(&mut s).unwrap(),
            Some(Message::HelloAck(_))
        ));
        // Something every 100 ms for 1.2 s: four idle timeouts' worth.
        for seq in 0..12 {
            write_message(&mut s, &Message::ClockProbe { seq, t1: 1 }).unwrap();
            std::thread::sleep(Duration::from_millis(100));
        }
        // Then silence: the host closes within about one idle timeout.
        let t = Instant::now();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 4096];
        while matches!(s.read(&mut b), Ok(n) if n > 0) {}
        t.elapsed()
    })
    .await
    .unwrap();
    assert!(ended_after < Duration::from_secs(2), "{ended_after:?}");
    until(&mut inbox, |e| {
        matches!(e.kind, EventKind::Disconnected { .. })
    })
    .await;
    let a = account(&server, "v");
    assert_eq!((a.idle_timeouts, a.bad_connections), (1, 1), "{a:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_says_bye_to_a_connected_guest_at_once() {
    let p = tmp_sock("stop");
    let (server, _inbox) = serve(unix_cfg(&[(&p, "v")])).await.unwrap();
    let mut s = UnixStream::connect(&p).unwrap();
    write_message(&mut s, &Message::Hello(local_hello("v", None))).unwrap();
    assert!(matches!(
        read_message(&mut s).unwrap(),
        Some(Message::HelloAck(_))
    ));
    let t = Instant::now();
    server.shutdown(Duration::from_secs(5)).await;
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let reason = tokio::task::spawn_blocking(move || loop {
        match read_message(&mut s) {
            Ok(Some(Message::Bye { reason })) => return reason,
            Ok(Some(_)) => continue,
            other => panic!("no bye: {other:?}"),
        }
    })
    .await
    .unwrap();
    assert_eq!(reason, "host agent stopping");
}

/// Whether `fd` is readable right now.
fn readable(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).unwrap() == 1
}

/// The agent's loop sleeps on its own clock: the inbox wakes it early once a
/// VM's undelivered records reach half its budget, and not before; taking
/// the inbox rearms the wake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_wakes_the_loop_at_half_a_vms_budget() {
    let p = tmp_sock("wake");
    let mut cfg = unix_cfg(&[(&p, "v")]);
    cfg.budget.records_pending = 1000;
    let (_server, mut inbox) = serve(cfg).await.unwrap();
    let g = GuestSender::start(fast_cfg(Endpoint::Unix(p.clone()))).unwrap();
    // Below half the budget: delivered, no wake.
    for i in 0..100 {
        g.send_rq(&rq(i));
    }
    let t0 = Instant::now();
    // (acked: decoded and handed to the inbox, which holds them)
    while g.stats().acked < 100 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "records not decoded"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!readable(inbox.wake_fd()), "woken below half the budget");
    // Past half: the wake fd is readable without the inbox being taken.
    for i in 100..700 {
        g.send_rq(&rq(i));
    }
    let t0 = Instant::now();
    while !readable(inbox.wake_fd()) {
        assert!(t0.elapsed() < Duration::from_secs(20), "no early wake");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    until_records(&mut inbox, 700).await;
    assert!(
        !readable(inbox.wake_fd()),
        "taking the inbox rearms the wake"
    );
    drop(g);
}

/// A batch whose structure is sound but one record's contents are not is
/// delivered whole (the reader refuses that record alone, for the agent to
/// count); a batch whose structure is broken drops the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_record_is_left_to_the_reader_and_a_bad_batch_drops_the_guest() {
    use crate::proto::{encode_frame, BatchReader, GuestRecord, FRAME_HEADER};
    let p = tmp_sock("badrec");
    let (server, mut inbox) = serve(unix_cfg(&[(&p, "vm-r")])).await.unwrap();
    let frame = |first_seq| {
        let records = (0..3).map(|i| GuestRecord::Rq(rq(i))).collect();
        encode_frame(&Message::Batch { first_seq, records }).unwrap()
    };
    // The second record's flags: after the header, the tag, the sequence
    // number and the count, the first record (tag, length, body), then the
    // second's tag and length.
    let mut f = frame(0);
    let at = FRAME_HEADER + 3;
    let second = at + 2 + usize::from(f[at + 1]);
    f[second + 2] = 0xff;
    let mut broken = frame(3);
    // An unknown record tag.
    broken[FRAME_HEADER + 3] = 9;
    let client = tokio::task::spawn_blocking(move || {
        let mut s = UnixStream::connect(&p).unwrap();
        write_message(&mut s, &Message::Hello(local_hello("r", None))).unwrap();
        let _ = read_message(&mut s);
        s.write_all(&f).unwrap();
        s.write_all(&broken).unwrap();
        while let Ok(Some(_)) = read_message(&mut s) {}
    });
    let (mut good, mut bad, mut dropped) = (0, Vec::new(), None);
    let mut reader = BatchReader::new();
    until(&mut inbox, |e| {
        match e.kind {
            EventKind::Records { batch, .. } => reader.read(&batch, |r| match r {
                Ok(_) => good += 1,
                Err(e) => bad.push(e.to_string()),
            }),
            EventKind::Disconnected { reason, error, .. } => dropped = Some((reason, error)),
            _ => {}
        }
        dropped.is_some()
    })
    .await;
    client.await.unwrap();
    assert_eq!(good, 2);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("record 1"), "{bad:?}");
    let (reason, error) = dropped.unwrap();
    assert!(error && reason.contains("bad frame"), "{reason}");
    let a = account(&server, "vm-r");
    assert_eq!((a.delivered, a.bad_connections), (3, 1), "{a:?}");
    server.shutdown(Duration::from_secs(2)).await;
}
