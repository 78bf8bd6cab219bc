use super::*;
use crate::record::{Points, RqRef};

pub(crate) fn rq(i: u64) -> GuestRq {
    sample_rq(i)
}

pub(crate) fn io() -> GuestIo {
    GuestIo {
        time: None,
        syscall: "pwrite64".into(),
        pid: 1,
        tid: 1,
        comm: "dd".into(),
        cgroup_id: 0,
        inode: 5,
        file_offset: None,
        bytes: 4096,
        ret: 4096,
        requests: smallvec::smallvec![RqRef {
            disk: "vda".into(),
            sector: 8,
            bytes: 4096,
        }],
        requests_unlisted: 2,
        ts: Points::new(),
        off_cpu: Some(crate::record::OffCpu {
            runnable_ns: 5,
            blocked_ns: 7,
            holder: Some("pid 1 x".into()),
        }),
        cause: None,
    }
}

fn all_messages() -> Vec<Message> {
    vec![
        Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            agent_version: "0.1.0".into(),
            kernel_release: "6.1.0-28-cloud-amd64".into(),
            boot_id: "0b6c7f7e-1111-2222-3333-444455556666".into(),
            hostname: "guest".into(),
            cid: Some(3),
            session: 0xdead_beef,
        }),
        Message::HelloAck(HelloAck {
            protocol_version: PROTOCOL_VERSION,
            agent_version: "0.1.0".into(),
            vm: "vm1".into(),
            resume: Some(7),
        }),
        Message::Batch {
            first_seq: 1 << 40,
            records: (0..10)
                .map(|i| GuestRecord::Rq(rq(i)))
                .chain(std::iter::once(GuestRecord::Io(io())))
                .collect(),
        },
        Message::ClockProbe { seq: 1, t1: 10 },
        Message::ClockReply {
            seq: 1,
            t1: 10,
            t2: 20,
            t3: 21,
        },
        Message::ClockSample {
            seq: 1,
            t1: 10,
            t2: 20,
            t3: 21,
            t4: 30,
        },
        Message::ClockPing {
            seq: 9,
            h1: u64::MAX,
        },
        Message::ClockPong {
            seq: 9,
            h1: u64::MAX,
            g2: 1,
            g3: 2,
        },
        Message::GuestStats(GuestStats {
            ts: 5,
            produced: 10,
            dropped_full: 3,
            counters: vec![Counter {
                name: "ringbuf_drops".into(),
                value: 2,
            }],
        }),
        Message::Bye {
            reason: "sigint".into(),
        },
        Message::Ack { next_seq: 300 },
    ]
}

impl GuestRecord {
    fn into_batch(self, first_seq: u64) -> Message {
        Message::Batch {
            first_seq,
            records: vec![self],
        }
    }
}

#[test]
fn every_message_roundtrips_and_tags_are_counted() {
    let msgs = all_messages();
    assert_eq!(msgs.len() as u64, MESSAGE_TAGS);
    for m in msgs {
        let f = encode_frame(&m).unwrap();
        let len = u32::from_le_bytes(f[..4].try_into().unwrap()) as usize;
        assert_eq!(len + 4, f.len());
        assert_eq!(decode_payload(&f[4..]).unwrap(), m);
    }
}

#[test]
fn incremental_decoder_byte_by_byte() {
    let msgs = all_messages();
    let mut stream = Vec::new();
    for m in &msgs {
        encode_frame_into(m, &mut stream).unwrap();
    }
    let mut d = FrameDecoder::new();
    let mut got = Vec::new();
    for b in &stream {
        d.feed(std::slice::from_ref(b));
        while let Some(m) = d.next_message().unwrap() {
            got.push(m);
        }
    }
    assert_eq!(got, msgs);
    d.finish().unwrap();
    assert_eq!(d.frames(), msgs.len() as u64);
}

/// Reads straight into the decoder's buffer, in pieces of at most `piece`
/// bytes, as the host's read loop does.
fn read_in_pieces(stream: &[u8], piece: usize, min: usize, max: usize) -> Vec<Message> {
    let mut d = FrameDecoder::with_max(max);
    let mut got = Vec::new();
    let mut rest = stream;
    while !rest.is_empty() {
        let room = d.read_room(min);
        let free = room.capacity() - room.len();
        assert!(free >= min, "room {free} < {min}");
        let n = piece.min(free).min(rest.len());
        room.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
        while let Some(m) = d.next_message().unwrap() {
            got.push(m);
        }
        // Never more than a partial frame plus one read, plus the growth.
        assert!(d.buf.capacity() <= 4 * (max + FRAME_HEADER + min));
    }
    d.finish().unwrap();
    got
}

#[test]
fn read_room_gives_what_the_frame_lacks_and_decodes_the_same() {
    let msgs = all_messages();
    let mut stream = Vec::new();
    for _ in 0..20 {
        for m in &msgs {
            encode_frame_into(m, &mut stream).unwrap();
        }
    }
    let want: Vec<Message> = (0..20).flat_map(|_| msgs.clone()).collect();
    for (piece, min) in [(1, 1), (7, 16), (100, 64), (4096, 1024), (1 << 20, 4096)] {
        assert_eq!(read_in_pieces(&stream, piece, min, MAX_FRAME), want);
    }
    // A large frame: the room covers the rest of it in one read.
    let big = Message::Bye {
        reason: "x".repeat(100_000),
    };
    let f = encode_frame(&big).unwrap();
    let mut d = FrameDecoder::new();
    d.read_room(16).extend_from_slice(&f[..10]);
    assert!(d.next_message().unwrap().is_none());
    let room = d.read_room(16);
    assert!(room.capacity() - room.len() >= f.len() - 10);
    room.extend_from_slice(&f[10..]);
    assert_eq!(d.next_message().unwrap(), Some(big));
    // An announced frame above the limit asks for no more than the limit.
    let mut d = FrameDecoder::with_max(1000);
    d.read_room(4).extend_from_slice(&u32::MAX.to_le_bytes());
    let room = d.read_room(4);
    assert!(room.capacity() < 4096, "{}", room.capacity());
    assert!(matches!(
        d.next_message(),
        Err(ProtoError::Oversized { .. })
    ));
}

#[test]
fn truncated_stream_is_reported() {
    let f = encode_frame(&Message::ClockProbe { seq: 1, t1: 2 }).unwrap();
    let mut d = FrameDecoder::new();
    d.feed(&f[..f.len() - 1]);
    assert!(d.next_message().unwrap().is_none());
    assert!(matches!(d.finish(), Err(ProtoError::Truncated { .. })));
    let mut d = FrameDecoder::new();
    d.feed(&f[..2]);
    assert!(matches!(
        d.finish(),
        Err(ProtoError::Truncated { have: 2, need: 4 })
    ));
    // Blocking reader.
    let mut r = &f[..f.len() - 1];
    assert!(matches!(
        read_message(&mut r),
        Err(ProtoError::Truncated { .. })
    ));
    let mut r = &f[..];
    assert!(read_message(&mut r).unwrap().is_some());
    assert!(read_message(&mut r).unwrap().is_none());
}

#[test]
fn oversized_frame_is_refused_and_poisons() {
    let mut d = FrameDecoder::new();
    d.feed(&((MAX_FRAME as u32) + 1).to_le_bytes());
    assert!(matches!(
        d.next_message(),
        Err(ProtoError::Oversized { .. })
    ));
    assert!(matches!(d.next_message(), Err(ProtoError::Poisoned)));
    let hdr = u32::MAX.to_le_bytes();
    let mut r = &hdr[..];
    assert!(matches!(
        read_message(&mut r),
        Err(ProtoError::Oversized { .. })
    ));
}

#[test]
fn unknown_and_malformed_and_trailing() {
    assert!(matches!(
        decode_payload(&[MESSAGE_TAGS as u8]),
        Err(ProtoError::UnknownMessage(t)) if t == MESSAGE_TAGS
    ));
    assert!(matches!(
        decode_payload(&[0xff, 0xff, 0x03]),
        Err(ProtoError::UnknownMessage(_))
    ));
    // Hello with a truncated body.
    assert!(matches!(
        decode_payload(&[0, 1]),
        Err(ProtoError::Malformed(_))
    ));
    // Varint that never ends.
    assert!(matches!(
        decode_payload(&[0x80; 12]),
        Err(ProtoError::Malformed(_)) | Err(ProtoError::UnknownMessage(_))
    ));
    let mut f = encode_frame(&Message::Bye { reason: "x".into() }).unwrap();
    f.push(0);
    assert!(matches!(
        decode_payload(&f[4..]),
        Err(ProtoError::TrailingBytes(1))
    ));
    assert!(matches!(decode_payload(&[]), Err(ProtoError::EmptyFrame)));
    // Bad points inside a record are malformed, not a panic.
    let mut good = encode_frame(&GuestRecord::Rq(rq(1)).into_batch(0)).unwrap();
    let n = good.len();
    // ts is last: [len=6][id mask: 2 bytes][2 differences of 2 bytes]; a
    // continuation bit on the first difference's last byte leaves the second
    // one no bytes.
    good[n - 3] = 200;
    let r = decode_payload(&good[4..]);
    assert!(r.is_err());
}

#[test]
fn decoder_continues_after_a_bad_payload() {
    let mut s = Vec::new();
    s.extend_from_slice(&1u32.to_le_bytes());
    s.push(99);
    encode_frame_into(
        &Message::Bye {
            reason: "ok".into(),
        },
        &mut s,
    )
    .unwrap();
    let mut d = FrameDecoder::new();
    d.feed(&s);
    assert!(matches!(
        d.next_message(),
        Err(ProtoError::UnknownMessage(99))
    ));
    assert!(matches!(d.next_message(), Ok(Some(Message::Bye { .. }))));
}

#[test]
fn records_encode_the_same_by_reference() {
    // (a request record over 127 bytes has a two-byte length)
    let mut long = rq(4);
    long.comm = "c".repeat(150).into();
    for rec in [
        GuestRecord::Rq(rq(3)),
        GuestRecord::Rq(long),
        GuestRecord::Io(io()),
    ] {
        let want = postcard::to_allocvec(&rec).unwrap();
        assert_eq!(postcard::from_bytes::<GuestRecord>(&want).unwrap(), rec);
        assert_eq!(encode_record(&rec).unwrap(), want);
        // into a reused buffer that still holds an earlier record's bytes
        let mut buf = vec![0xff; 7];
        encode_record_into(&rec.borrowed(), &mut buf).unwrap();
        assert_eq!(buf, want);
        // appended after other bytes, which stay (a capture's open chunk)
        let mut buf = vec![0xee; 5];
        encode_record_append(&rec.borrowed(), &mut buf).unwrap();
        assert_eq!(&buf[..5], &[0xee; 5]);
        assert_eq!(&buf[5..], &want[..]);
    }
    // A record too large for any frame leaves what was there untouched.
    let mut huge = rq(5);
    huge.comm = "c".repeat(MAX_FRAME).into();
    let mut buf = vec![0xdd; 3];
    assert!(matches!(
        encode_record_append(&GuestRecord::Rq(huge).borrowed(), &mut buf),
        Err(ProtoError::Oversized { .. })
    ));
    assert_eq!(buf, [0xdd; 3]);
}

#[test]
fn batch_frames_from_pre_encoded_records_equal_postcard() {
    let recs: Vec<GuestRecord> = (0..300).map(|i| GuestRecord::Rq(rq(i))).collect();
    let enc: Vec<Vec<u8>> = recs.iter().map(|r| encode_record(r).unwrap()).collect();
    for first in [0u64, 1, 127, 128, 1 << 35] {
        let mut out = Vec::new();
        batch_frame(first, enc.len(), enc.iter().map(|v| v.as_slice()), &mut out);
        let want = encode_frame(&Message::Batch {
            first_seq: first,
            records: recs.clone(),
        })
        .unwrap();
        assert_eq!(out, want);
    }
    let mut out = Vec::new();
    batch_frame(9, 0, std::iter::empty(), &mut out);
    assert_eq!(
        decode_payload(&out[4..]).unwrap(),
        Message::Batch {
            first_seq: 9,
            records: vec![]
        }
    );
    // A single record too large for any frame is refused.
    let mut big = rq(0);
    big.comm = "x".repeat(MAX_FRAME).into();
    assert!(matches!(
        encode_record(&GuestRecord::Rq(big)),
        Err(ProtoError::Oversized { .. })
    ));
}

#[test]
fn version_check() {
    check_version(PROTOCOL_VERSION).unwrap();
    assert!(matches!(
        check_version(PROTOCOL_VERSION + 1),
        Err(ProtoError::Version { .. })
    ));
}

proptest::proptest! {
    #[test]
    fn decoder_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        let mut d = FrameDecoder::new();
        d.feed(&data);
        for _ in 0..64 {
            match d.next_message() {
                Ok(Some(_)) => {}
                Ok(None) | Err(ProtoError::Poisoned) => break,
                Err(_) => {}
            }
        }
        let _ = d.finish();
        let _ = decode_payload(&data);
    }
}

/// A batch's records reuse the previous record's names only when the bytes
/// are the same: changing, returning, long (heap) and empty names all
/// come back as sent, and a bad name after a good one is still refused.
#[test]
fn batch_names_change_and_repeat_as_sent() {
    let names = [
        ("vda", "fio"),
        ("vda", "kworker/0:1H"),
        ("vdb", "fio"),
        ("vdb", "fio"),
        ("", ""),
        (
            "a-disk-name-longer-than-24-bytes",
            "a-task-name-longer-than-24-bytes",
        ),
        ("a-disk-name-longer-than-24-bytes", "fio"),
        ("vda", "fio"),
    ];
    let records: Vec<GuestRecord> = (0..names.len())
        .map(|i| {
            let mut r = rq(i as u64);
            (r.disk, r.comm) = (names[i].0.into(), names[i].1.into());
            GuestRecord::Rq(r)
        })
        .collect();
    let m = Message::Batch {
        first_seq: 3,
        records,
    };
    let f = encode_frame(&m).unwrap();
    assert_eq!(decode_payload(&f[4..]).unwrap(), m);
    // The same length as "fio", not UTF-8, right after a "fio".
    let mut bad = f[4..].to_vec();
    let last = bad.windows(3).rposition(|w| w == b"fio").unwrap();
    bad[last] = 0xff;
    assert!(decode_payload(&bad).is_err());
}
