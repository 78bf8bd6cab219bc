use super::samples::*;
use super::*;

#[test]
fn every_c_point_slot_names_a_guest_point() {
    let slots = point_slots();
    assert_eq!(slots.iter().flatten().count(), C_POINTS.len());
    let guest_points = Point::ALL
        .iter()
        .filter(|p| p.name().starts_with("g."))
        .count();
    assert_eq!(C_POINTS.len(), guest_points, "{C_POINTS:?}");
    assert_eq!((K_RQ, K_IO), (1, 2));
}

proptest::proptest! {
    /// The host reads a request record sent as the ring buffer held it
    /// (`rq_bpf`, through a batch frame) into the record this decoder
    /// makes of it; its time from the guest's wall-clock offset sent with it.
    #[test]
    fn the_host_decodes_a_record_sent_as_is_as_this_decoder_does(
        ts in proptest::collection::vec(proptest::option::of(1u64..u64::MAX / 4), rq_bpf::TS_LEN),
        (sector, cgroup, inode, offset) in (proptest::num::u64::ANY, proptest::num::u64::ANY,
            proptest::num::u64::ANY, proptest::num::u64::ANY),
        (bytes, op, pid, tid, bios, status) in (proptest::num::u32::ANY, 0u32..40,
            proptest::num::u32::ANY, proptest::num::u32::ANY, proptest::num::u32::ANY, -2i32..14),
        (queue, head, flags, kicked) in (proptest::num::u16::ANY, proptest::num::u16::ANY,
            0u8..8, 0u8..3),
        comm in proptest::collection::vec(proptest::num::u8::ANY, 16),
        wall in -(1i64 << 60)..(1i64 << 60),
    ) {
        let mut b = raw_rq();
        for (i, t) in ts.iter().enumerate() {
            put(&mut b, 8 + 8 * i, &t.unwrap_or(0).to_ne_bytes());
        }
        for (o, v) in [(104, sector), (112, cgroup), (120, inode), (128, offset)] {
            put(&mut b, o, &v.to_ne_bytes());
        }
        for (o, v) in [(136, bytes), (140, op | (bytes & 0xff00)), (144, pid), (148, tid), (152, bios)] {
            put(&mut b, o, &v.to_ne_bytes());
        }
        put(&mut b, 156, &status.to_ne_bytes());
        put(&mut b, 160, &queue.to_ne_bytes());
        put(&mut b, 162, &head.to_ne_bytes());
        (b[164], b[165], b[166], b[167]) = (flags & 1, flags >> 1 & 1, kicked, flags >> 2 & 1);
        b[168..184].copy_from_slice(&comm);
        let mut d = decoder();
        let Record::Rq(mine) = d.decode(&b).unwrap() else {
            panic!("not a request")
        };
        let mut want = mine.clone();
        want.time = want.ts.min_max().map(|(first, _)| {
            viotrace_shared::walltime::WallTime((first as i64).saturating_add(wall))
        });
        let mut rec = Vec::new();
        rq_bpf::encode_record(&b, wall, &mine.disk, &mut rec).unwrap();
        let mut frame = Vec::new();
        viotrace_shared::proto::batch_frame(5, 1, [&rec[..]], &mut frame);
        let msg = viotrace_shared::proto::decode_payload(&frame[4..]).unwrap();
        let viotrace_shared::proto::Message::Batch { first_seq, records } = msg else {
            panic!("not a batch")
        };
        proptest::prop_assert_eq!(first_seq, 5);
        proptest::prop_assert_eq!(
            records,
            vec![viotrace_shared::proto::GuestRecord::Rq(want)]
        );
    }
}

proptest::proptest! {
    /// A capture reads a syscall record written as the ring buffer held it
    /// (`io_bpf`, through a batch), its references named as the
    /// tables-only decode named them, into the record this decoder makes of
    /// it in full; its time from the guest's wall-clock offset sent with it.
    #[test]
    fn a_capture_reads_a_syscall_record_as_this_decoder_does(
        (nr, enter, exit) in (proptest::sample::select(vec![0u32, 1, 17, 18, 209, 426, 500]),
            proptest::num::u64::ANY, proptest::num::u64::ANY),
        (ret, bytes, inode, offset, cgroup) in (proptest::num::i64::ANY, proptest::num::u64::ANY,
            proptest::num::u64::ANY, proptest::num::u64::ANY, proptest::num::u64::ANY),
        (pid, tid, has_offset) in (proptest::num::u32::ANY, proptest::num::u32::ANY, 0u8..2),
        refs in proptest::collection::vec((proptest::num::u64::ANY, 0u32..3,
            proptest::num::u32::ANY), 0..=MAX_REFS),
        comm in proptest::collection::vec(proptest::num::u8::ANY, 16),
        wall in -(1i64 << 60)..(1i64 << 60),
    ) {
        let mut b = raw_io();
        put(&mut b, 4, &nr.to_ne_bytes());
        for (o, v) in [(8, enter), (16, exit), (32, bytes), (40, inode), (48, offset), (56, cgroup)] {
            put(&mut b, o, &v.to_ne_bytes());
        }
        put(&mut b, 24, &ret.to_ne_bytes());
        put(&mut b, 64, &pid.to_ne_bytes());
        put(&mut b, 68, &tid.to_ne_bytes());
        put(&mut b, 72, &(refs.len() as u32).to_ne_bytes());
        b[80] = has_offset;
        b[88..104].copy_from_slice(&comm);
        // (vdb, an unnamed disk, and another)
        let devs = [(253u32 << 20) | 16, (259 << 20) | 77, (259 << 20) | 78];
        for (i, &(sector, dev, len)) in refs.iter().enumerate() {
            put(&mut b, 104 + 16 * i, &sector.to_ne_bytes());
            put(&mut b, 112 + 16 * i, &devs[dev as usize].to_ne_bytes());
            put(&mut b, 116 + 16 * i, &len.to_ne_bytes());
        }
        let mut d = decoder();
        let Record::Io(mine) = d.decode(&b).unwrap() else {
            panic!("not a syscall")
        };
        let mut want = mine.clone();
        want.time = want.ts.min_max().map(|(first, _)| {
            viotrace_shared::walltime::WallTime((first as i64).saturating_add(wall))
        });
        let mut tables = decoder();
        tables.tables_only = true;
        let Record::Io(seen) = tables.decode(&b).unwrap() else {
            panic!("not a syscall")
        };
        proptest::prop_assert_eq!((&seen.ts, &seen.syscall), (&mine.ts, &mine.syscall));
        let mut rec = Vec::new();
        let disks = seen.requests.iter().map(|r| r.disk.as_str());
        io_bpf::encode_record(&b, wall, disks, &mut rec).unwrap();
        let mut frame = Vec::new();
        viotrace_shared::proto::batch_frame(5, 1, [&rec[..]], &mut frame);
        let msg = viotrace_shared::proto::decode_payload(&frame[4..]).unwrap();
        let viotrace_shared::proto::Message::Batch { records, .. } = msg else {
            panic!("not a batch")
        };
        proptest::prop_assert_eq!(records, vec![viotrace_shared::proto::GuestRecord::Io(want)]);
    }
}

fn decoder() -> Decoder {
    let mut d = Decoder::new();
    d.name_disk((253u32 << 20) | 16, "vdb");
    d
}

#[test]
fn decodes_request_record() {
    let mut d = decoder();
    let Record::Rq(r) = d.decode(&raw_rq()).unwrap() else {
        panic!("not a request")
    };
    assert_eq!(r.disk, "vdb");
    assert_eq!(r.op, Op::Write);
    assert_eq!((r.sector, r.bytes, r.bios), (2048, 4096, 2));
    assert_eq!((r.queue, r.head), (Some(1), Some(37)));
    assert_eq!((r.pid, r.tid, r.comm.as_str()), (100, 101, "fio"));
    assert_eq!((r.cgroup_id, r.inode, r.file_offset), (77, 12, Some(8192)));
    assert_eq!(r.kicked, Some(false));
    assert_eq!(r.error, 0);
    // unseen points are absent, not 0
    assert_eq!(r.ts.len(), 4);
    assert_eq!(r.ts.get(Point::RqIssue), Some(2000));
    assert_eq!(r.ts.get(Point::Kick), None);
    let j = serde_json::to_string(&r.ts).unwrap();
    assert!(!j.contains("g.kick") && j.contains("\"g.vq_add\":2100"));
}

#[test]
fn tables_only_skips_what_only_outputs_read() {
    let mut d = decoder();
    d.tables_only = true;
    let Record::Rq(r) = d.decode(&raw_rq()).unwrap() else {
        panic!("not a request")
    };
    // (what the tables read is all there)
    assert_eq!((r.disk.as_str(), r.ts.len()), ("vdb", 4));
    assert_eq!((r.time, r.comm.as_str()), (None, ""));
    assert_eq!((r.sector, r.bytes, r.pid, r.queue), (0, 0, 0, None));
    d.tables_only = false;
    let Record::Rq(r) = d.decode(&raw_rq()).unwrap() else {
        panic!("not a request")
    };
    assert!(r.time.is_some());
    assert_eq!(r.comm, "fio");
}

#[test]
fn absent_optionals_and_errors() {
    let mut b = raw_rq();
    b[164] = 0;
    b[165] = 0;
    b[166] = 0;
    b[167] = 0;
    put(&mut b, 156, &10u32.to_ne_bytes()); // BLK_STS_IOERR
    put(&mut b, 168, b"kworker/0:1\0");
    // After a record that had them all: nothing of it stays.
    let mut d = decoder();
    assert!(matches!(d.decode(&raw_rq()), Ok(Record::Rq(_))));
    let Record::Rq(r) = d.decode(&b).unwrap() else {
        panic!()
    };
    assert_eq!(
        (r.queue, r.head, r.kicked, r.file_offset),
        (None, None, None, None)
    );
    assert_eq!(r.error, -5);
    assert_eq!(r.comm, "kworker/0:1");
}

#[test]
fn flush_has_sector_zero() {
    let mut b = raw_rq();
    put(&mut b, 140, &2u32.to_ne_bytes());
    put(&mut b, 104, &u64::MAX.to_ne_bytes());
    let mut d = Decoder::new();
    let Record::Rq(r) = d.decode(&b).unwrap() else {
        panic!()
    };
    assert_eq!((r.op, r.sector), (Op::Flush, 0));
}

#[test]
fn a_misaligned_record_decodes_as_an_aligned_one() {
    let raw = raw_rq();
    let mut buf = vec![0u8; raw.len() + 16];
    let o = buf.as_ptr().align_offset(8);
    buf[o..o + raw.len()].copy_from_slice(&raw);
    let mut d = decoder();
    let aligned = match d.decode(&buf[o..o + raw.len()]).unwrap() {
        Record::Rq(r) => r.clone(),
        _ => panic!(),
    };
    buf.copy_within(o..o + raw.len(), o + 1);
    let Record::Rq(r) = d.decode(&buf[o + 1..o + 1 + raw.len()]).unwrap() else {
        panic!()
    };
    assert_eq!(*r, aligned);
    assert_eq!((r.sector, r.ts.len()), (2048, 4));
}

#[test]
fn rejects_short_and_unknown() {
    let mut d = Decoder::new();
    assert_eq!(
        d.decode(&raw_rq()[..100]),
        Err(DecodeError::Short {
            got: 100,
            need: RQ_SIZE
        })
    );
    assert!(matches!(d.decode(&[1, 2]), Err(DecodeError::Short { .. })));
    assert_eq!(d.decode(&[9, 0, 0, 0, 0]), Err(DecodeError::Kind(9)));
}

#[test]
fn decodes_syscall_record_and_names_refs_by_dev() {
    let mut d = decoder();
    let mut b = raw_io();
    let Record::Io(io) = d.decode(&b).unwrap() else {
        panic!()
    };
    assert_eq!(io.syscall, "pwrite64");
    assert_eq!(
        (io.ret, io.bytes, io.inode, io.file_offset),
        (4096, 4096, 12, Some(8192))
    );
    assert_eq!(
        io.requests.to_vec(),
        vec![RqRef {
            disk: "vdb".into(),
            sector: 2048,
            bytes: 4096
        }]
    );
    assert_eq!(io.ts.get(Point::SyscallEnter), Some(500));
    assert_eq!(io.ts.get(Point::SyscallExit), Some(9500));
    // negative return values survive
    put(&mut b, 24, &(-5i64).to_ne_bytes());
    let Record::Io(io) = d.decode(&b).unwrap() else {
        panic!()
    };
    assert_eq!(io.ret, -5);
    // The next syscall's record keeps nothing of this one's.
    put(&mut b, 4, &0u32.to_ne_bytes()); // read
    put(&mut b, 72, &0u32.to_ne_bytes()); // no request
    put(&mut b, 88, b"dd\0");
    let Record::Io(io) = d.decode(&b).unwrap() else {
        panic!()
    };
    assert_eq!((io.syscall.as_str(), io.comm.as_str()), ("read", "dd"));
    assert!(io.requests.is_empty());
}

#[test]
fn syscall_names() {
    assert_eq!(syscall_name(426), "io_uring_enter");
    assert_eq!(syscall_name(999), "syscall_999");
    assert_eq!(STAT_NAMES.len(), 28);
    assert_eq!(STAT_NAMES[0], "ringbuf_drop_rq");
    assert_eq!(STAT_NAMES[19], "bio_chain_truncated");
    assert_eq!(STAT_NAMES[21], "io_hist_full");
    assert_eq!(STAT_NAMES[22], "driver_complete_unseen");
    assert_eq!(STAT_NAMES[23], "syscall_exit_unseen");
    assert_eq!(STAT_NAMES[24], "syscall_file_unseen");
    assert_eq!(STAT_NAMES[25], "syscall_entry_lost");
    assert_eq!(STAT_NAMES[26], "syscall_states_hashed");
    assert_eq!(STAT_NAMES[27], "rq_issue_unseen");
}
