//! The sink's tests (sink.rs).

use super::*;
use crate::raw::samples::{put, raw_io, raw_rq};
use crate::raw::Decoder;
use std::cell::RefCell;
use std::rc::Rc;
use viotrace_shared::capture::{CaptureReader, Item};
use viotrace_shared::proto::GuestRecord;
use viotrace_shared::record::Op;

/// A capture target the test reads back.
#[derive(Clone, Default)]
struct Shared(Rc<RefCell<Vec<u8>>>);
impl Write for Shared {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Pairs of raw records (a request, then its syscall) that differ in
/// their sector and times, as a run of I/Os does.
fn raw_pairs(n: u64) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for i in 0..n {
        let (mut rq, mut io) = (raw_rq(), raw_io());
        put(&mut rq, 104, &(2048 + 8 * i).to_ne_bytes());
        put(&mut rq, 8, &(i * 10_000 + 1).to_ne_bytes()); // first point slot
        put(&mut io, 8, &(i * 10_000).to_ne_bytes());
        put(&mut io, 16, &(i * 10_000 + 9_500).to_ne_bytes());
        put(&mut io, 104, &(2048 + 8 * i).to_ne_bytes());
        out.push(rq);
        out.push(io);
    }
    out
}

/// Request records as always-on gets them: every point a fentry-mode
/// request has (slots 1..=10 of `C_POINTS`), each stage a few
/// microseconds that vary by record.
fn raw_full_rqs(n: u64) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let mut rq = raw_rq();
            put(&mut rq, 104, &(2048 + 8 * i).to_ne_bytes());
            let mut t = 1_000_000_000 + i * 40_000;
            for slot in 1..=10u64 {
                t += 1_000 + (i * 7 + slot * 13) % 5_000;
                put(&mut rq, 8 + 8 * slot as usize, &t.to_ne_bytes());
            }
            rq
        })
        .collect()
}

/// Always-on's per-record path (also the callgrind harness of
/// PERFORMANCE.md: `--toggle-collect` on `Sink::handle` and
/// `Decoder::decode`): every request counts once in every stage of its
/// disk's table.
#[test]
fn always_on_counts_every_request_in_every_stage() {
    let raw = raw_full_rqs(20_000);
    let mut s = Sink::new(false, None, "fentry".into(), vec![], vec![], None);
    let mut d = Decoder::new();
    d.tables_only = true;
    d.name_disk((253u32 << 20) | 16, "vdb");
    for r in &raw {
        s.handle(d.decode(r).unwrap(), r);
    }
    assert_eq!((s.rqs, s.decode_errors), (20_000, 0));
    let sums = s.interval.summaries();
    let stages: Vec<&str> = sums.iter().map(|s| s.stage.as_str()).collect();
    let want = [
        "guest_queue",
        "guest_driver",
        "device",
        "guest_complete",
        "total",
    ];
    assert_eq!(stages, want);
    for st in &sums {
        assert_eq!(
            (st.label.as_str(), st.summary.count),
            ("vdb", 20_000),
            "{st:?}"
        );
    }
}

/// Syscall records counted aside by syscall come to the same table as
/// recorded one by one, also when the syscalls alternate and across
/// intervals.
#[test]
fn syscall_latencies_reach_the_table_as_recorded_one_by_one() {
    let nrs = [18u32, 17, 209, 17, 0];
    let mut s = Sink::new(false, None, "fentry".into(), vec![], vec![], None);
    let mut d = Decoder::new();
    d.tables_only = true;
    d.name_disk((253u32 << 20) | 16, "vdb");
    let mut want = Aggregator::new();
    for i in 0..3_000u64 {
        let nr = nrs[(i as usize * 7 / 3) % nrs.len()];
        let ns = 1 + (i * 7_919) % 3_000_000;
        let mut io = raw_io();
        put(&mut io, 4, &nr.to_ne_bytes());
        put(&mut io, 8, &1_000u64.to_ne_bytes());
        put(&mut io, 16, &(1_000 + ns).to_ne_bytes());
        s.handle(d.decode(&io).unwrap(), &io);
        want.record(SYSCALL_LABEL, &crate::raw::syscall_name(nr), ns);
        if i == 1_000 {
            // (the interval's table holds the interval's syscalls)
            s.interval_table(Duration::from_secs(1));
            let n: u64 = s.total.summaries().iter().map(|x| x.summary.count).sum();
            assert_eq!(n, 1_001);
        }
    }
    s.take_syscalls();
    let mut got = std::mem::take(&mut s.total);
    got.merge(&s.interval);
    let key = |a: &Aggregator| {
        let mut v: Vec<String> = a
            .summaries()
            .iter()
            .map(|x| format!("{} {} {:?}", x.label, x.stage, x.summary))
            .collect();
        v.sort();
        v
    };
    assert_eq!(key(&got), key(&want));
    assert_eq!(key(&got).len(), 4);
}

#[test]
fn the_capture_holds_every_handled_record_as_decoded() {
    let raw = raw_pairs(2_000);
    let file = Shared::default();
    let hello = viotrace_shared::transport::local_hello("test", None);
    let w = CaptureWriter::new(Box::new(file.clone()) as Box<dyn Write>, &hello).unwrap();
    let mut s = Sink::new(false, None, "fentry".into(), vec![], vec![], None);
    s.set_capture(w, false);
    let mut d = Decoder::new();
    d.tables_only = true; // (as the agent decodes for a capture)
    d.name_disk((253u32 << 20) | 16, "vdb");
    for r in &raw {
        s.handle(d.decode(r).unwrap(), r);
    }
    s.flush();
    assert_eq!((s.rqs, s.ios, s.decode_errors), (2_000, 2_000, 0));

    let mut d = Decoder::new();
    d.name_disk((253u32 << 20) | 16, "vdb");
    let bytes = file.0.borrow().clone();
    let mut rd = CaptureReader::new(&bytes[..]).unwrap();
    for (i, r) in raw.iter().enumerate() {
        let got = match rd.next() {
            Some(Ok(Item::Record(g))) => g,
            other => panic!("record {i}: {other:?}"),
        };
        let want = match d.decode(r).unwrap() {
            Record::Rq(r) => GuestRecord::Rq(r.clone()),
            Record::Io(io) => GuestRecord::Io(io.clone()),
        };
        assert_eq!(got, want, "record {i}");
    }
    // (no end chunk: the sink was not finished)
    assert!(matches!(rd.next(), Some(Err(_))));
}

#[test]
fn json_lines_carry_kind_first_and_only_seen_points() {
    let mut ts = Points::new();
    ts.set(Point::RqIssue, 5);
    let r = GuestRq {
        time: None,
        disk: "vda".into(),
        op: Op::Read,
        sector: 8,
        bytes: 512,
        queue: None,
        head: Some(3),
        pid: 1,
        tid: 1,
        comm: "dd".into(),
        cgroup_id: 1,
        inode: 0,
        file_offset: None,
        kicked: None,
        bios: 1,
        error: 0,
        ts,
    };
    let l = json_line(&r).unwrap();
    assert!(
        l.starts_with("{\"kind\":\"guest_rq\",\"disk\":\"vda\""),
        "{l}"
    );
    assert!(l.contains("\"ts\":{\"g.rq_issue\":5}"));
    let v: serde_json::Value = serde_json::from_str(&l).unwrap();
    assert_eq!(v["head"], 3);
    assert!(v["queue"].is_null());
    let back: GuestRq = serde_json::from_value(v).unwrap();
    assert_eq!(back, r);
    assert_eq!(crate::raw::syscall_name(0), "read");
}
