use super::*;
use crate::proto::{BatchReader, GuestRecordRef, RawBatch};
use crate::record::OffCpu;
use proptest::prelude::*;

/// A syscall record with `n` references, on two disks.
fn io(n: usize) -> GuestIo {
    GuestIo {
        syscall: "io_submit".into(),
        time: None,
        pid: 41,
        tid: 42,
        comm: "fio".into(),
        cgroup_id: 77,
        inode: 12,
        file_offset: Some(40_960),
        bytes: 4096,
        ret: 1,
        requests: (0..n)
            .map(|i| RqRef {
                disk: if i % 2 == 0 { "vdb" } else { "nvme0n1" }.into(),
                sector: 8 * i as u64,
                bytes: 4096 + i as u32,
            })
            .collect(),
        requests_unlisted: if n == MAX_REFS { 5 } else { 0 },
        ts: [(Point::SyscallEnter, 1_000), (Point::SyscallExit, 9_000)]
            .into_iter()
            .collect(),
        off_cpu: None,
        cause: None,
    }
}

/// A batch entry's body (tag and length taken off).
fn body(bpf: &[u8], offset: i64, disks: &[String]) -> Vec<u8> {
    let mut v = Vec::new();
    encode_record(bpf, offset, disks.iter().map(String::as_str), &mut v).unwrap();
    assert_eq!(v[0], TAG);
    let mut rest = &v[1..];
    let len = varint::take(&mut rest).unwrap() as usize;
    assert_eq!(rest.len(), len);
    rest.to_vec()
}

fn roundtrip(want: &GuestIo, offset: i64) -> GuestIo {
    let (bpf, disks) = bpf_of(want);
    let mut got = GuestIo::default();
    decode_into(&body(&bpf, offset, &disks), &mut got).unwrap();
    got
}

#[test]
fn decodes_every_field() {
    for n in [0, 1, 2, MAX_REFS] {
        let want = io(n);
        let got = roundtrip(&want, 5_000);
        assert_eq!(got.time, Some(WallTime(6_000)), "{n}");
        assert_eq!(
            got,
            GuestIo {
                time: Some(WallTime(6_000)),
                ..want
            }
        );
    }
    // The body copies the head and the references in use, nothing more.
    let (bpf, disks) = bpf_of(&io(1));
    assert_eq!(
        body(&bpf, 0, &disks).len(),
        HEAD_LEN + REF_LEN + 8 + 1 + "vdb".len()
    );
}

#[test]
fn the_syscall_number_is_read_where_the_layout_keeps_it() {
    let (bpf, _) = bpf_of(&io(1));
    assert_eq!(syscall_nr(&bpf), Some(209));
    assert_eq!(syscall_nr(&bpf[..off::NR + 4]), Some(209));
    assert_eq!(syscall_nr(&bpf[..off::NR + 3]), None);
}

#[test]
fn absent_fields_and_unknown_syscalls() {
    let mut want = io(1);
    want.file_offset = None;
    want.syscall = "syscall_400".into();
    want.ts = [(Point::SyscallEnter, 7)].into_iter().collect();
    let got = roundtrip(&want, -3);
    assert_eq!(got.time, Some(WallTime(4)));
    assert_eq!(got.file_offset, None);
    assert_eq!(&*got.syscall, "syscall_400");
    want.ts = Points::new();
    assert_eq!(roundtrip(&want, 5).time, None);
}

#[test]
fn decoding_over_a_used_record_leaves_nothing_of_it() {
    let mut got = GuestIo::default();
    let (bpf, disks) = bpf_of(&io(3));
    decode_into(&body(&bpf, 0, &disks), &mut got).unwrap();
    got.off_cpu = Some(OffCpu::default());
    let (bpf, disks) = bpf_of(&io(1));
    decode_into(&body(&bpf, 0, &disks), &mut got).unwrap();
    assert_eq!(
        got,
        GuestIo {
            time: Some(WallTime(1_000)),
            ..io(1)
        }
    );
}

#[test]
fn the_encoder_refuses_what_the_layout_cannot_hold() {
    let (bpf, disks) = bpf_of(&io(2));
    let names = || disks.iter().map(String::as_str);
    let mut out = Vec::new();
    // Too short, another kind, names that do not match the references.
    assert!(encode_record(&bpf[..RECORD_LEN - 1], 0, names(), &mut out).is_none());
    let mut rq = bpf.clone();
    rq[off::KIND] = 1;
    assert!(encode_record(&rq, 0, names(), &mut out).is_none());
    assert!(encode_record(&bpf, 0, names().take(1), &mut out).is_none());
    let long = "x".repeat(MAX_DISK + 1);
    assert!(encode_record(&bpf, 0, [long.as_str(), "vdb"].into_iter(), &mut out).is_none());
    let mut many = bpf.clone();
    many[off::NREFS] = MAX_REFS as u8 + 1;
    let names17 = vec!["vdb"; MAX_REFS + 1];
    assert!(encode_record(&many, 0, names17.into_iter(), &mut out).is_none());
    assert!(out.is_empty());
}

#[test]
fn the_decoder_refuses_what_the_bpf_side_never_writes() {
    let (bpf, disks) = bpf_of(&io(2));
    let good = body(&bpf, 0, &disks);
    let mut io = GuestIo::default();
    let err = |b: &[u8]| decode_into(b, &mut GuestIo::default()).unwrap_err();
    assert!(decode_into(&good, &mut io).is_ok());
    assert_eq!(err(&good[..HEAD_LEN]), RqWireError::IoLength(HEAD_LEN));
    assert!(matches!(
        err(&good[..good.len() - 1]),
        RqWireError::IoLength(_)
    ));
    let mut longer = good.clone();
    longer.push(0);
    assert!(matches!(err(&longer), RqWireError::IoLength(_)));
    let mut b = good.clone();
    b[off::KIND] = 1;
    assert_eq!(err(&b), RqWireError::Tag(1));
    let mut b = good.clone();
    b[off::NREFS] = 17;
    assert_eq!(err(&b), RqWireError::Range("nrefs"));
    let mut b = good.clone();
    b[off::HAS_FILE_OFFSET] = 2;
    assert_eq!(err(&b), RqWireError::Range("has_file_offset"));
    let names = HEAD_LEN + 2 * REF_LEN + 8;
    let mut b = good.clone();
    b[names + 1] = 0xff;
    assert_eq!(err(&b), RqWireError::Utf8);
    let mut b = good.clone();
    b[names] = MAX_DISK as u8 + 1;
    assert_eq!(err(&b), RqWireError::Range("disk name"));
}

#[test]
fn a_batch_reads_it_between_the_other_records() {
    let mut entries = Vec::new();
    crate::proto::rq_bpf::entry_of(&crate::proto::sample_rq(1), &mut entries);
    let (bpf, disks) = bpf_of(&io(2));
    encode_record(&bpf, 0, disks.iter().map(String::as_str), &mut entries).unwrap();
    crate::proto::encode_record_append(&GuestRecordRef::Io(&io(1)), &mut entries).unwrap();
    let mut frame = Vec::new();
    crate::proto::batch_frame(5, 3, [&entries[..]], &mut frame);
    let msg = crate::proto::decode_payload(&frame[crate::proto::FRAME_HEADER..]).unwrap();
    let crate::proto::Message::Batch { records, .. } = msg else {
        panic!("{msg:?}")
    };
    assert_eq!(records.len(), 3);
    let want = GuestIo {
        time: Some(WallTime(1_000)),
        ..io(2)
    };
    assert_eq!(records[1], crate::proto::GuestRecord::Io(want.clone()));
    assert_eq!(records[2], crate::proto::GuestRecord::Io(io(1)));
    // The reader that keeps one record of each kind reads the same.
    let raw = RawBatch::skim(&frame[crate::proto::FRAME_HEADER + 1..]).unwrap();
    let mut got = Vec::new();
    BatchReader::new().read(&raw, |r| {
        if let Ok(GuestRecordRef::Io(io)) = r {
            got.push(io.clone());
        }
    });
    assert_eq!(got, vec![want, io(1)]);
}

proptest! {
    #[test]
    fn any_record_reads_back_as_itself(
        n in 0..=MAX_REFS, enter in 1u64..u64::MAX / 2, d in 0u64..1 << 40,
        ret in any::<i64>(), off in proptest::option::of(any::<u64>()),
        nr in prop::sample::select(vec![0u32, 1, 17, 18, 209, 426, 999]),
        wall in -(1i64 << 62)..(1i64 << 62),
    ) {
        let mut want = io(n);
        want.syscall = syscall_name(nr);
        want.ts = [(Point::SyscallEnter, enter), (Point::SyscallExit, enter + d)]
            .into_iter()
            .collect();
        want.ret = ret;
        want.file_offset = off;
        let got = roundtrip(&want, wall);
        want.time = Some(WallTime((enter as i64).saturating_add(wall)));
        prop_assert_eq!(got, want);
    }

    #[test]
    fn any_damage_is_an_error_or_a_record_never_a_panic(
        at in 0usize..200, x in 1u8..=255, cut in 0usize..200,
    ) {
        let (bpf, disks) = bpf_of(&io(3));
        let mut b = body(&bpf, 0, &disks);
        let at = at % b.len();
        b[at] ^= x;
        let _ = decode_into(&b, &mut GuestIo::default());
        b.truncate(cut.min(b.len()));
        let _ = decode_into(&b, &mut GuestIo::default());
    }
}
