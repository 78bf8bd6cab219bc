use super::*;
use crate::proto::{read_message, write_message, HelloAck};
use crate::record::{Op, Points};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

/// A fresh socket path in the temp directory. The first call removes the
/// sockets earlier test processes left there (theirs, once they are gone).
pub(crate) fn tmp_sock(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    static SWEPT: std::sync::Once = std::sync::Once::new();
    SWEPT.call_once(remove_stale_socks);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("viotrace-t-{}-{tag}-{n}.sock", std::process::id()))
}

/// Removes `viotrace-t-PID-*` entries of processes that no longer exist.
fn remove_stale_socks() {
    let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("viotrace-t-"))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

pub(crate) fn rq(i: u64) -> GuestRq {
    GuestRq {
        time: None,
        disk: "vda".into(),
        op: Op::Read,
        sector: i * 8,
        bytes: 4096,
        queue: Some(0),
        head: Some((i % 256) as u16),
        pid: i as u32,
        tid: 1,
        comm: "t".into(),
        cgroup_id: 0,
        inode: 0,
        file_offset: None,
        kicked: None,
        bios: 1,
        error: 0,
        ts: Points::new(),
    }
}

pub(crate) fn fast_cfg(ep: Endpoint) -> GuestSenderConfig {
    let mut c = GuestSenderConfig::new(ep, local_hello("test", Some(3)));
    c.flush_interval = Duration::from_millis(5);
    c.probe_interval = Duration::from_millis(20);
    c.backoff_min = Duration::from_millis(10);
    c.backoff_max = Duration::from_millis(40);
    c
}

fn accept_hello(lis: &UnixListener, resume: Option<u64>) -> (UnixStream, Hello) {
    let (mut s, _) = lis.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let h = match read_message(&mut s).unwrap() {
        Some(Message::Hello(h)) => h,
        other => panic!("{other:?}"),
    };
    let ack = HelloAck {
        protocol_version: PROTOCOL_VERSION,
        agent_version: "h".into(),
        vm: "vm".into(),
        resume,
    };
    write_message(&mut s, &Message::HelloAck(ack)).unwrap();
    (s, h)
}

/// Reads until `want` records arrived (acking each batch when `ack`);
/// returns the sequence numbers and pids seen.
fn read_records(s: &mut UnixStream, want: usize, ack: bool) -> Vec<(u64, u32)> {
    let mut got = Vec::new();
    while got.len() < want {
        if let Message::Batch { first_seq, records } = read_message(s).unwrap().unwrap() {
            for (k, r) in records.iter().enumerate() {
                match r {
                    GuestRecord::Rq(r) => got.push((first_seq + k as u64, r.pid)),
                    GuestRecord::Io(_) => panic!("no io records sent"),
                }
            }
            if ack {
                let next_seq = first_seq + records.len() as u64;
                write_message(s, &Message::Ack { next_seq }).unwrap();
            }
        }
    }
    got
}

/// The guest sender against a minimal blocking host: handshake, numbered
/// records, acks, pong, probe, final stats and bye.
#[test]
fn guest_sender_against_a_std_host() {
    let path = tmp_sock("std");
    let lis = UnixListener::bind(&path).unwrap();
    let tx = GuestSender::start(fast_cfg(Endpoint::Unix(path.clone()))).unwrap();
    for i in 0..5000 {
        tx.send_rq(&rq(i));
    }
    let (mut s, h) = accept_hello(&lis, None);
    assert_eq!(h.protocol_version, PROTOCOL_VERSION);
    assert_eq!(h.cid, Some(3));
    assert_ne!(h.session, local_hello("x", None).session);
    let got = read_records(&mut s, 5000, true);
    for (k, (seq, pid)) in got.iter().enumerate() {
        assert_eq!((*seq, *pid as usize), (k as u64, k), "in order, numbered");
    }
    write_message(&mut s, &Message::ClockPing { seq: 7, h1: 1 }).unwrap();
    let (mut pong, mut probe) = (false, None);
    while !pong || probe.is_none() {
        match read_message(&mut s).unwrap().unwrap() {
            Message::ClockPong { seq, h1, g2, g3 } => {
                assert_eq!((seq, h1), (7, 1));
                assert!(g3 >= g2 && g2 > 0);
                pong = true;
            }
            Message::ClockProbe { seq, t1 } => probe = Some((seq, t1)),
            _ => {}
        }
    }
    let (seq, t1) = probe.unwrap();
    let reply = Message::ClockReply {
        seq,
        t1,
        t2: 100,
        t3: 101,
    };
    write_message(&mut s, &reply).unwrap();
    loop {
        if let Message::ClockSample {
            seq: s2, t1: a, t4, ..
        } = read_message(&mut s).unwrap().unwrap()
        {
            assert_eq!((s2, a), (seq, t1));
            assert!(t4 >= t1);
            break;
        }
    }
    let closer = std::thread::spawn(move || tx.shutdown("test done", Duration::from_secs(5)));
    let mut final_stats = None;
    loop {
        match read_message(&mut s).unwrap() {
            Some(Message::GuestStats(st)) => final_stats = Some(st),
            Some(Message::Bye { reason }) => {
                assert_eq!(reason, "test done");
                break;
            }
            Some(_) => {}
            None => panic!("closed without bye"),
        }
    }
    let st = final_stats.expect("final stats before bye");
    assert_eq!((st.produced, st.dropped_full), (5000, 0));
    let st = closer.join().unwrap();
    assert_eq!((st.produced, st.acked, st.lost()), (5000, 5000, 0));
    let _ = std::fs::remove_file(&path);
}

/// Records offered before the first connection wait; a full buffer refuses
/// (and counts) new ones, never evicting numbered ones.
#[test]
fn buffer_is_bounded_before_the_first_connection() {
    let path = tmp_sock("late");
    let mut cfg = fast_cfg(Endpoint::Unix(path.clone()));
    cfg.max_buffered = 100;
    let tx = GuestSender::start(cfg).unwrap();
    for i in 0..150 {
        tx.send_rq(&rq(i));
    }
    std::thread::sleep(Duration::from_millis(60));
    let st = tx.stats();
    assert_eq!((st.produced, st.dropped_full), (100, 50));
    assert!(st.connect_failures >= 1);
    assert!(!st.connected);
    let lis = UnixListener::bind(&path).unwrap();
    let (mut s, _) = accept_hello(&lis, None);
    let got = read_records(&mut s, 100, true);
    assert_eq!(got, (0..100).map(|i| (i, i as u32)).collect::<Vec<_>>());
    let st = tx.shutdown("done", Duration::from_secs(5));
    assert_eq!(
        (st.acked, st.dropped_full, st.unacked_at_exit),
        (100, 50, 0)
    );
    assert_eq!(st.offered(), 150);
    let _ = std::fs::remove_file(&path);
}

/// Unacknowledged records survive a lost connection and are resent from where
/// the host says it stands.
#[test]
fn unacknowledged_records_are_resent_after_a_reconnection() {
    let path = tmp_sock("resume");
    let lis = UnixListener::bind(&path).unwrap();
    let tx = GuestSender::start(fast_cfg(Endpoint::Unix(path.clone()))).unwrap();
    for i in 0..3000 {
        tx.send_rq(&rq(i));
    }
    let (mut s, h1) = accept_hello(&lis, None);
    // Take everything, acknowledge nothing, and drop the connection.
    let first = read_records(&mut s, 3000, false);
    assert_eq!(first.len(), 3000);
    drop(s);
    // The host got the first 1234: the guest resumes there.
    let (mut s, h2) = accept_hello(&lis, Some(1234));
    assert_eq!(h1.session, h2.session, "same agent, same session");
    let again = read_records(&mut s, 3000 - 1234, true);
    assert_eq!(again.first(), Some(&(1234, 1234)));
    assert_eq!(again.last(), Some(&(2999, 2999)));
    let st = tx.shutdown("done", Duration::from_secs(5));
    assert_eq!((st.acked, st.lost()), (3000, 0));
    assert_eq!(st.resent, 3000 - 1234);
    let _ = std::fs::remove_file(&path);
}

/// Records never acknowledged by the time the sender stops are counted.
#[test]
fn unacknowledged_at_exit_is_counted() {
    let path = tmp_sock("noack");
    let lis = UnixListener::bind(&path).unwrap();
    let tx = GuestSender::start(fast_cfg(Endpoint::Unix(path.clone()))).unwrap();
    for i in 0..10 {
        tx.send_rq(&rq(i));
    }
    let (mut s, _) = accept_hello(&lis, None);
    read_records(&mut s, 10, false);
    let st = tx.shutdown("done", Duration::from_millis(300));
    assert_eq!((st.produced, st.acked, st.unacked_at_exit), (10, 0, 10));
    let _ = std::fs::remove_file(&path);
}

/// A host side that stays open but silent (as some vsock backends leave a guest
/// socket after the host closed its end) is given up, and everything is resent
/// on a new connection.
#[test]
fn a_silent_connection_is_given_up_and_records_resent() {
    let path = tmp_sock("silent");
    let lis = UnixListener::bind(&path).unwrap();
    let mut cfg = fast_cfg(Endpoint::Unix(path.clone()));
    cfg.dead_after = Duration::from_millis(300);
    let tx = GuestSender::start(cfg).unwrap();
    for i in 0..100 {
        tx.send_rq(&rq(i));
    }
    let t = Instant::now();
    let (_silent, _) = accept_hello(&lis, None);
    let (mut s, _) = accept_hello(&lis, None);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let got = read_records(&mut s, 100, true);
    assert_eq!(got.first(), Some(&(0, 0)));
    let st = tx.shutdown("done", Duration::from_secs(5));
    assert_eq!((st.acked, st.lost(), st.connects), (100, 0, 2));
    let _ = std::fs::remove_file(&path);
}
