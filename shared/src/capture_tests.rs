use super::*;
use crate::cause::{Cause, CauseKind};
use crate::jsonl::JsonLines;
use crate::record::{GuestIo, GuestRq, Op, Point, RqRef};
use crate::walltime::WallTime;

fn hello() -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        agent_version: "0.1.0".into(),
        kernel_release: "6.1.0-28-cloud-amd64".into(),
        boot_id: "b".into(),
        hostname: "guest".into(),
        cid: Some(3),
        session: 99,
    }
}

/// The protocol tests' request, varied per record (op, queue, kick, a wall time, one more point).
fn rq(i: u64) -> GuestRq {
    GuestRq {
        time: Some(WallTime(1_700_000_000_000_000_000 + i as i64)),
        disk: "vdb".into(),
        op: if i.is_multiple_of(2) {
            Op::Read
        } else {
            Op::Write
        },
        queue: Some((i % 2) as u16),
        kicked: Some(i.is_multiple_of(3)),
        ts: [
            (Point::SyscallEnter, 900 + i),
            (Point::RqIssue, 1000 + i),
            (Point::RqComplete, 2000 + i),
        ]
        .into_iter()
        .collect(),
        ..crate::proto::tests::rq(i)
    }
}

/// The protocol tests' syscall record, with a name to escape, an error and (every other one)
/// a why-slow verdict.
fn io(i: u64) -> GuestIo {
    GuestIo {
        comm: "dd \"quoted\"".into(),
        ret: -5,
        requests: smallvec::smallvec![RqRef {
            disk: "vdb".into(),
            sector: 8 * i,
            bytes: 4096,
        }],
        ts: [(Point::SyscallEnter, 10), (Point::SyscallExit, 90_000)]
            .into_iter()
            .collect(),
        cause: i.is_multiple_of(2).then(|| {
            Box::new(Cause {
                kind: CauseKind::GuestBlocked,
                stage: "blocked".into(),
                stage_ns: 80_000,
                baseline_ns: 1000,
                total_ns: 90_000,
                baseline_total_ns: 2000,
                evidence: "slept".into(),
            })
        }),
        ..crate::proto::tests::io()
    }
}

fn records(n: u64) -> Vec<GuestRecord> {
    (0..n)
        .map(|i| {
            if i % 3 == 2 {
                GuestRecord::Io(io(i))
            } else {
                GuestRecord::Rq(rq(i))
            }
        })
        .collect()
}

const STATS: &str = "{\"kind\":\"stats\",\"final\":true}\n";

fn capture(recs: &[GuestRecord]) -> Vec<u8> {
    let mut w = CaptureWriter::new(Vec::new(), &hello()).unwrap();
    for r in recs {
        w.push(r.borrowed());
    }
    w.flush();
    assert_eq!((w.written, w.lost), (recs.len() as u64, 0));
    w.finish(STATS.as_bytes()).unwrap()
}

fn read_all(bytes: &[u8]) -> (Vec<GuestRecord>, Result<String, CaptureError>) {
    let rd = match CaptureReader::new(bytes) {
        Ok(r) => r,
        Err(e) => return (Vec::new(), Err(e)),
    };
    let mut recs = Vec::new();
    for item in rd {
        match item {
            Ok(Item::Record(r)) => recs.push(r),
            Ok(Item::End(l)) => return (recs, Ok(l)),
            Err(e) => return (recs, Err(e)),
        }
    }
    (recs, Err(CaptureError::NoHello))
}

#[test]
fn records_read_back_in_order_across_chunks() {
    // Enough records for several 64 KiB chunks.
    let recs = records(3000);
    let bytes = capture(&recs);
    assert!(bytes.len() > 2 * CHUNK_BYTES, "{}", bytes.len());
    let rd = CaptureReader::new(&bytes[..]).unwrap();
    assert_eq!(rd.hello, hello());
    let (back, end) = read_all(&bytes);
    assert_eq!(back, recs);
    assert_eq!(end.unwrap(), STATS);
}

#[test]
fn rendering_matches_the_live_json_lines() {
    let recs = records(50);
    let mut live = JsonLines::new(Vec::new());
    for r in &recs {
        match r {
            GuestRecord::Rq(x) => live.write(x).unwrap(),
            GuestRecord::Io(x) => live.write(x).unwrap(),
        }
    }
    let mut want = std::mem::take(live.get_mut());
    want.extend_from_slice(STATS.as_bytes());
    let bytes = capture(&recs);
    let mut out = Vec::new();
    let n = render_json(&mut CaptureReader::new(&bytes[..]).unwrap(), &mut out).unwrap();
    assert_eq!(n, 50);
    assert_eq!(
        String::from_utf8(out).unwrap(),
        String::from_utf8(want).unwrap()
    );
}

#[test]
fn every_cut_of_a_capture_is_an_error_after_the_records_before_it() {
    let recs = records(40);
    let bytes = capture(&recs);
    for cut in 0..bytes.len() {
        let (back, end) = read_all(&bytes[..cut]);
        let e = end.expect_err("a cut capture must not read as complete");
        assert!(
            matches!(
                e,
                CaptureError::BadMagic(_)
                    | CaptureError::NoHello
                    | CaptureError::Truncated { .. }
                    | CaptureError::NoEnd { .. }
            ),
            "cut {cut}: {e}"
        );
        assert_eq!(back, recs[..back.len()], "cut {cut}");
    }
    // Cut right before the end chunk: every record, and the missing end named.
    let end_at = bytes.len() - CHUNK_HEADER - STATS.len();
    let (back, end) = read_all(&bytes[..end_at]);
    assert_eq!(back.len(), 40);
    assert!(
        matches!(end, Err(CaptureError::NoEnd { records: 40 })),
        "{end:?}"
    );
}

#[test]
fn damage_is_named_not_panicked_on() {
    let bytes = capture(&records(10));
    let mut bad_magic = bytes.clone();
    bad_magic[0] = b'X';
    assert!(matches!(
        CaptureReader::new(&bad_magic[..]),
        Err(CaptureError::BadMagic(_))
    ));
    // Every single flipped byte: an error or the same records, never a panic.
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0xa5;
        let _ = read_all(&b);
    }
    let mut trailing = bytes.clone();
    trailing.extend_from_slice(b"junk");
    assert!(matches!(
        read_all(&trailing).1,
        Err(CaptureError::AfterEnd(4))
    ));
    let mut unknown = bytes[..bytes.len() - CHUNK_HEADER - STATS.len()].to_vec();
    unknown.extend_from_slice(&[9, 0, 0, 0, 0]);
    assert!(matches!(
        read_all(&unknown).1,
        Err(CaptureError::UnknownChunk { kind: 9, .. })
    ));
    let mut huge = bytes[..bytes.len() - CHUNK_HEADER - STATS.len()].to_vec();
    huge.extend_from_slice(&[RECORDS, 0xff, 0xff, 0xff, 0x7f]);
    assert!(matches!(
        read_all(&huge).1,
        Err(CaptureError::Oversized { .. })
    ));
}

#[test]
fn another_protocol_version_is_refused_by_name() {
    for v in [OLDEST_VERSION - 1, PROTOCOL_VERSION + 1] {
        let mut h = hello();
        h.protocol_version = v;
        let mut w = CaptureWriter::new(Vec::new(), &h).unwrap();
        w.push(GuestRecord::Rq(rq(1)).borrowed());
        w.flush();
        let bytes = w.finish(STATS.as_bytes()).unwrap();
        let e = CaptureReader::new(&bytes[..]).err().unwrap();
        assert!(matches!(e, CaptureError::Version { .. }), "{e}");
    }
    // Protocol 7's captures (compact request records only) still read.
    let mut h = hello();
    h.protocol_version = 7;
    let mut w = CaptureWriter::new(Vec::new(), &h).unwrap();
    w.push(GuestRecord::Rq(rq(1)).borrowed());
    let bytes = w.finish(STATS.as_bytes()).unwrap();
    let (recs, end) = read_all(&bytes);
    assert_eq!(recs, vec![GuestRecord::Rq(rq(1))]);
    assert!(end.is_ok());
}

#[test]
fn request_records_in_the_bpf_layout_read_back_between_the_others() {
    let bpf = crate::proto::rq_bpf::tests::bpf_record();
    let mut w = CaptureWriter::new(Vec::new(), &hello()).unwrap();
    w.push(GuestRecord::Rq(rq(1)).borrowed());
    w.push_rq_bpf(&bpf, 5_000, "vdb");
    w.push(GuestRecord::Rq(rq(2)).borrowed());
    // Not a request record of the layout: lost alone, counted.
    w.push_rq_bpf(&bpf[..10], 0, "vdb");
    assert_eq!((w.written, w.lost), (0, 1));
    let bytes = w.finish(STATS.as_bytes()).unwrap();
    let (recs, end) = read_all(&bytes);
    assert_eq!(end.unwrap(), STATS);
    let mut want = crate::proto::rq::blank();
    let mut body = Vec::new();
    crate::proto::rq_bpf::encode_record(&bpf, 5_000, "vdb", &mut body).unwrap();
    // (tag, a two-byte length, the body)
    crate::proto::rq_bpf::decode_into(&body[3..], &mut want).unwrap();
    assert_eq!(
        recs,
        vec![
            GuestRecord::Rq(rq(1)),
            GuestRecord::Rq(want),
            GuestRecord::Rq(rq(2))
        ]
    );
}

/// A file that takes `room` bytes, then fails every write.
struct Fills {
    room: usize,
    data: Vec<u8>,
}

impl Write for Fills {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        if self.data.len() + b.len() > self.room {
            return Err(io::Error::other("No space left on device"));
        }
        self.data.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_full_disk_counts_every_record_it_refused() {
    let recs = records(3000);
    let out = Fills {
        room: 100_000,
        data: Vec::new(),
    };
    let mut w = CaptureWriter::new(out, &hello()).unwrap();
    for r in &recs {
        w.push(r.borrowed());
    }
    w.flush();
    assert_eq!(w.written + w.lost, 3000);
    assert!(w.written > 0 && w.lost > 0, "{} {}", w.written, w.lost);
    assert!(w.failed.as_deref().unwrap().contains("No space"));
    // What reached the file reads back: the written records, then the cut
    // chunk or the missing end is named.
    let (back, end) = read_all(&w.get_ref().data);
    assert_eq!(back, recs[..w.written as usize]);
    assert!(
        matches!(
            end,
            Err(CaptureError::Truncated { .. } | CaptureError::NoEnd { .. })
        ),
        "{end:?}"
    );
    let e = w.finish(STATS.as_bytes()).err().unwrap();
    assert!(e.to_string().contains("No space"), "{e}");
}

#[test]
fn syscall_records_in_the_bpf_layout_read_back_between_the_others() {
    let mut bare = io(1); // (odd: no cause)
    bare.off_cpu = None;
    let (bpf, disks) = crate::proto::io_bpf::bpf_of(&bare);
    let names = || disks.iter().map(String::as_str);
    let mut w = CaptureWriter::new(Vec::new(), &hello()).unwrap();
    w.push(GuestRecord::Rq(rq(1)).borrowed());
    w.push_io_bpf(&bpf, 5_000, names());
    w.push(GuestRecord::Io(io(2)).borrowed());
    // Names that do not match its references: lost alone, counted.
    w.push_io_bpf(&bpf, 0, names().take(0));
    assert_eq!((w.written, w.lost), (0, 1));
    let bytes = w.finish(STATS.as_bytes()).unwrap();
    let (recs, end) = read_all(&bytes);
    assert_eq!(end.unwrap(), STATS);
    let want = GuestIo {
        time: Some(WallTime(10 + 5_000)),
        ..bare
    };
    assert_eq!(
        recs,
        vec![
            GuestRecord::Rq(rq(1)),
            GuestRecord::Io(want),
            GuestRecord::Io(io(2))
        ]
    );
}

#[test]
fn format_1_reads_and_a_newer_format_is_refused_by_name() {
    let recs = records(10);
    let mut bytes = capture(&recs);
    assert_eq!(bytes[7], FORMAT);
    bytes[7] = 1;
    let (back, end) = read_all(&bytes);
    assert_eq!((back, end.unwrap()), (recs, STATS.to_string()));
    bytes[7] = FORMAT + 1;
    let e = CaptureReader::new(&bytes[..]).err().unwrap();
    assert!(matches!(e, CaptureError::Format { got: 4 }), "{e}");
    assert!(e.to_string().contains("reads formats 1 to 3"), "{e}");
}
