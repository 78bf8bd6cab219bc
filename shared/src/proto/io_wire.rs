//! A syscall record ([`GuestIo`]) in postcard's encoding, written field by
//! field instead of through serde's per-field calls (a capture holds one per
//! traced syscall, and serde's path was half of its encoding cost). The bytes
//! are exactly postcard's, so every reader decodes them with serde as before;
//! a differential test holds the two to that. Record tag 4 (since capture
//! format 3); tag 1 is the same form without `requests_unlisted` ([`IoV1`]).

/// A tag-1 syscall record: [`GuestIo`] as it was before `requests_unlisted`
/// (captures of format 1 and 2), read as postcard wrote it and then made a
/// [`GuestIo`] with nothing unlisted.
#[derive(serde::Deserialize)]
pub(crate) struct IoV1 {
    syscall: crate::record::Name,
    time: Option<crate::walltime::WallTime>,
    pid: u32,
    tid: u32,
    comm: crate::record::Name,
    cgroup_id: u64,
    inode: u64,
    file_offset: Option<u64>,
    bytes: u64,
    ret: i64,
    requests: smallvec::SmallVec<[crate::record::RqRef; 1]>,
    ts: crate::record::Points,
    off_cpu: Option<crate::record::OffCpu>,
    cause: Option<Box<crate::cause::Cause>>,
}

impl From<IoV1> for GuestIo {
    fn from(v: IoV1) -> GuestIo {
        GuestIo {
            syscall: v.syscall,
            time: v.time,
            pid: v.pid,
            tid: v.tid,
            comm: v.comm,
            cgroup_id: v.cgroup_id,
            inode: v.inode,
            file_offset: v.file_offset,
            bytes: v.bytes,
            ret: v.ret,
            requests: v.requests,
            requests_unlisted: 0,
            ts: v.ts,
            off_cpu: v.off_cpu,
            cause: v.cause,
        }
    }
}

use super::rq::push_str;
use crate::record::GuestIo;
use crate::varint::{self, zigzag};

/// postcard's `Option` tag: 0 for `None`, 1 before the value.
fn push_some(out: &mut Vec<u8>, some: bool) {
    out.push(u8::from(some));
}

/// Appends `io` as postcard encodes it (fields in declaration order).
pub fn encode(io: &GuestIo, out: &mut Vec<u8>) -> Result<(), postcard::Error> {
    encode_head(io, out);
    varint::push(out, u64::from(io.requests_unlisted));
    encode_tail(io, out)
}

/// The fields before `requests_unlisted`.
fn encode_head(io: &GuestIo, out: &mut Vec<u8>) {
    push_str(out, &io.syscall);
    push_some(out, io.time.is_some());
    if let Some(t) = io.time {
        varint::push(out, zigzag(t.0));
    }
    varint::push(out, u64::from(io.pid));
    varint::push(out, u64::from(io.tid));
    push_str(out, &io.comm);
    varint::push(out, io.cgroup_id);
    varint::push(out, io.inode);
    push_some(out, io.file_offset.is_some());
    if let Some(o) = io.file_offset {
        varint::push(out, o);
    }
    varint::push(out, io.bytes);
    varint::push(out, zigzag(io.ret));
    varint::push(out, io.requests.len() as u64);
    for r in &io.requests {
        push_str(out, &r.disk);
        varint::push(out, r.sector);
        varint::push(out, u64::from(r.bytes));
    }
}

/// The fields after `requests_unlisted`.
fn encode_tail(io: &GuestIo, out: &mut Vec<u8>) -> Result<(), postcard::Error> {
    io.ts.encode_wire_bytes_into(out);
    push_some(out, io.off_cpu.is_some());
    if let Some(o) = &io.off_cpu {
        varint::push(out, o.runnable_ns);
        varint::push(out, o.blocked_ns);
        push_some(out, o.holder.is_some());
        if let Some(h) = &o.holder {
            push_str(out, h);
        }
    }
    push_some(out, io.cause.is_some());
    if let Some(c) = &io.cause {
        // (rare: a slow syscall's verdict; serde's encoding, appended)
        *out = postcard::to_extend(&**c, std::mem::take(out))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cause::{Cause, CauseKind};
    use crate::record::{OffCpu, Point, Points, RqRef};
    use crate::walltime::WallTime;
    use proptest::prelude::*;

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![Just(String::new()), "[a-z0-9/:]{1,15}", "\\PC{0,40}",]
    }

    prop_compose! {
        fn points()(v in proptest::collection::vec((0..Point::ALL.len(), any::<u64>()), 0..6)) -> Points {
            let mut p = Points::new();
            for (i, t) in v {
                p.set(Point::ALL[i], t);
            }
            p
        }
    }

    prop_compose! {
        fn io()(
            (syscall, comm, disk, holder) in (name(), name(), name(), proptest::option::of(name())),
            time in proptest::option::of(any::<i64>()),
            (pid, tid, cgroup_id, inode) in (any::<u32>(), any::<u32>(), any::<u64>(), any::<u64>()),
            (file_offset, bytes, ret) in (proptest::option::of(any::<u64>()), any::<u64>(), any::<i64>()),
            refs in proptest::collection::vec((any::<u64>(), any::<u32>()), 0..4),
            requests_unlisted in prop_oneof![Just(0u32), any::<u32>()],
            ts in points(),
            off_cpu in proptest::option::of((any::<u64>(), any::<u64>())),
            cause in proptest::option::of((any::<i64>(), any::<i64>())),
        ) -> GuestIo {
            GuestIo {
                syscall: syscall.as_str().into(),
                time: time.map(WallTime),
                pid,
                tid,
                comm: comm.as_str().into(),
                cgroup_id,
                inode,
                file_offset,
                bytes,
                ret,
                requests: refs
                    .into_iter()
                    .map(|(sector, bytes)| RqRef { disk: disk.as_str().into(), sector, bytes })
                    .collect(),
                requests_unlisted,
                ts,
                off_cpu: off_cpu.map(|(runnable_ns, blocked_ns)| OffCpu {
                    runnable_ns,
                    blocked_ns,
                    holder: holder.clone(),
                }),
                cause: cause.map(|(stage_ns, total_ns)| {
                    Box::new(Cause {
                        kind: CauseKind::GuestQueue,
                        stage: "g.rq_insert→g.rq_issue".into(),
                        stage_ns,
                        baseline_ns: 10,
                        total_ns,
                        baseline_total_ns: 20,
                        evidence: holder.clone().unwrap_or_default(),
                    })
                }),
            }
        }
    }

    proptest! {
        /// The hand encoding is postcard's, byte for byte, and decodes back.
        #[test]
        fn the_encoding_is_postcards(io in io()) {
            let mut ours = Vec::new();
            encode(&io, &mut ours).unwrap();
            prop_assert_eq!(&ours, &postcard::to_allocvec(&io).unwrap());
            prop_assert_eq!(postcard::from_bytes::<GuestIo>(&ours).unwrap(), io);
        }

        /// A tag-1 record (the form before `requests_unlisted`, which the
        /// same code wrote without it) reads as the record, nothing unlisted.
        #[test]
        fn the_older_form_reads_with_nothing_unlisted(io in io()) {
            let mut old = Vec::new();
            encode_head(&io, &mut old);
            encode_tail(&io, &mut old).unwrap();
            let back: GuestIo = postcard::from_bytes::<IoV1>(&old).unwrap().into();
            let want = GuestIo { requests_unlisted: 0, ..io };
            prop_assert_eq!(&back, &want);
            // ... as a record of its tag, alone and in a batch
            let tagged = [&[1u8][..], &old].concat();
            let rec = postcard::from_bytes::<crate::proto::GuestRecord>(&tagged).unwrap();
            prop_assert_eq!(&rec, &crate::proto::GuestRecord::Io(want.clone()));
            let body = [&[0u8, 1][..], &tagged].concat();
            let batch = crate::proto::RawBatch::skim(&body).unwrap();
            prop_assert_eq!(batch.to_records().unwrap(), vec![rec]);
        }
    }
}
