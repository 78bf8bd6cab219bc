//! Tests of rq_summary.rs.
use super::*;
use crate::raw::{point_slots, Decoder, Record, RQ_SIZE};
use viotrace_shared::stats::hist_slot;

const VDB: u32 = 254 << 20 | 16;

/// A request record as the BPF side writes it: `ts[i]` for each `(i, t)`.
fn raw(dev: u32, ts: &[(usize, u64)]) -> Vec<u8> {
    let mut b = vec![0u8; RQ_SIZE];
    b[off::KIND..off::KIND + 4].copy_from_slice(&1u32.to_ne_bytes());
    b[off::DEV..off::DEV + 4].copy_from_slice(&dev.to_ne_bytes());
    for &(i, t) in ts {
        b[off::TS + 8 * i..off::TS + 8 * i + 8].copy_from_slice(&t.to_ne_bytes());
    }
    b
}

/// The BPF side's `ts[]` slot of a point.
fn slot(p: Point) -> usize {
    point_slots().iter().position(|&q| q == Some(p)).unwrap()
}

/// A virtio request's points, each 1 µs after the last, from bio_queue to bio_complete.
fn virtio_rq(dev: u32) -> Vec<u8> {
    let pts = [
        Point::BioQueue,
        Point::RqInsert,
        Point::QueueRq,
        Point::RqIssue,
        Point::VqAdd,
        Point::Kick,
        Point::Irq,
        Point::DriverComplete,
        Point::RqComplete,
        Point::BioComplete,
    ];
    let ts: Vec<(usize, u64)> = pts
        .iter()
        .enumerate()
        .map(|(k, &p)| (slot(p), 5_000 + 1_000 * k as u64 * (k as u64 + 1)))
        .collect();
    raw(dev, &ts)
}

/// Notes `b` as decoded, as the sink does.
fn note(s: &mut RqSummary, d: &mut Decoder, b: &[u8]) {
    d.name_disk(VDB, "vdb");
    match d.decode(b).unwrap() {
        Record::Rq(r) => s.note(b, &r.disk, &r.ts),
        Record::Io(_) => unreachable!(),
    }
}

/// The BPF side's counting of a record by plan `p`: (row, slot, value) per step.
fn apply(p: &rq_plan, b: &[u8]) -> Vec<(u16, usize, u64)> {
    let t = |i: u8| {
        let o = off::TS + 8 * usize::from(i);
        u64::from_ne_bytes(b[o..o + 8].try_into().unwrap())
    };
    assert_eq!(p.ready, 1);
    p.steps[..p.n as usize]
        .iter()
        .map(|s| {
            let d = t(s.to).saturating_sub(t(s.from));
            (s.row, hist_slot(d), d)
        })
        .collect()
}

#[test]
fn a_plan_counts_each_stage_as_the_tables_record_it() {
    let mut s = RqSummary::new(&point_slots());
    let mut d = Decoder::new();
    let b = virtio_rq(VDB);
    note(&mut s, &mut d, &b);
    let mut plans = [rq_plan::default(); RQ_PLANS];
    s.install(&mut plans);
    let (dev, mask) = key_of(&b).unwrap();
    assert_eq!(dev, VDB);
    let p = &plans[plan_index(dev, mask)];
    assert_eq!((p.dev, p.mask), (dev, mask));
    // Counted by the plan, into the rows' stages: the stages of the decoded record.
    let Record::Rq(r) = d.decode(&b).unwrap() else {
        unreachable!()
    };
    let want: Vec<(StageId, u64)> = stage_ends(&r.ts)
        .into_iter()
        .map(|(id, a, b)| (id, r.ts.get(b).unwrap() - r.ts.get(a).unwrap()))
        .collect();
    let got: Vec<(StageId, u64)> = apply(p, &b)
        .into_iter()
        .map(|(row, _, v)| (s.rows[usize::from(row)].1, v))
        .collect();
    assert_eq!(got, want);
    let names: Vec<&str> = got.iter().map(|g| g.0.name()).collect();
    assert_eq!(
        names,
        [
            "guest_queue",
            "guest_driver",
            "device",
            "guest_complete",
            "total"
        ]
    );
    // The same set again: nothing more to write.
    note(&mut s, &mut d, &b);
    assert!(s.wanted.is_empty());
}

#[test]
fn a_set_without_a_slot_or_rows_keeps_sending_records() {
    let mut s = RqSummary::new(&point_slots());
    let mut d = Decoder::new();
    let mut plans = [rq_plan::default(); RQ_PLANS];
    let b = virtio_rq(VDB);
    note(&mut s, &mut d, &b);
    s.install(&mut plans);
    let (dev, mask) = key_of(&b).unwrap();
    // Another disk whose (dev, mask) falls in the same slot.
    let other = (1..10_000u32)
        .map(|k| VDB + (k << 20))
        .find(|&dv| plan_index(dv, mask) == plan_index(dev, mask))
        .unwrap();
    let before = plans;
    note(&mut s, &mut d, &virtio_rq(other));
    s.install(&mut plans);
    assert_eq!(s.unplanned, 1);
    assert_eq!(s.rows.len(), 5, "no row taken for a refused set");
    assert!(plans
        .iter()
        .zip(&before)
        .all(|(a, b)| a.dev == b.dev && a.ready == b.ready));
    // Refused once, not noted again.
    note(&mut s, &mut d, &virtio_rq(other));
    assert!(s.wanted.is_empty());
    // Rows full: disks of 5 rows each until the 32 rows are taken.
    let mut full = RqSummary::new(&point_slots());
    let mut plans = [rq_plan::default(); RQ_PLANS];
    let mut k = 0;
    while full.unplanned == 0 {
        k += 1;
        let b = virtio_rq(VDB + (k << 20));
        let (dev, mask) = key_of(&b).unwrap();
        if full.planned[plan_index(dev, mask)].is_none() {
            note(&mut full, &mut d, &b);
            full.install(&mut plans);
        }
    }
    assert!(full.rows.len() <= RQ_ROWS && full.rows.len() + 5 > RQ_ROWS);
    // Its plan has no steps: its records come, without waking the agent.
    let b = virtio_rq(VDB + (k << 20));
    let (dev, mask) = key_of(&b).unwrap();
    assert_eq!(plans[plan_index(dev, mask)].n, 0);
    assert_eq!(plans[plan_index(dev, mask)].ready, 1);
    // A record with a single anchor: nothing to count, a plan of no steps.
    let one = raw(VDB, &[(slot(Point::RqComplete), 9)]);
    let (dev, mask) = key_of(&one).unwrap();
    let mut s = RqSummary::new(&point_slots());
    let mut plans = [rq_plan::default(); RQ_PLANS];
    note(&mut s, &mut d, &one);
    s.install(&mut plans);
    let p = &plans[plan_index(dev, mask)];
    assert_eq!((p.ready, p.dev, p.mask, p.n), (1, dev, mask, 0));
    assert_eq!((s.unplanned, s.rows.len()), (0, 0));
}

#[test]
fn rows_hand_on_their_gains_with_their_sums() {
    let mut s = RqSummary::new(&point_slots());
    let mut d = Decoder::new();
    note(&mut s, &mut d, &virtio_rq(VDB));
    let mut plans = [rq_plan::default(); RQ_PLANS];
    s.install(&mut plans);
    let mut rows = vec![[0u32; ROW_SLOTS]; RQ_ROWS];
    let mut counts = vec![0u64; RQ_ROWS];
    let mut sums = [0u64; RQ_ROWS];
    rows[4][hist_slot(30_000)] = 2;
    counts[4] = 2;
    sums[4] = 61_000;
    let g = s.take(&rows, &counts, |i| sums[i]);
    assert_eq!(g.len(), 1);
    assert_eq!((g[0].stage, g[0].disk.as_str()), (StageId::TOTAL, "vdb"));
    assert_eq!(g[0].slots, vec![(hist_slot(30_000), 2)]);
    assert_eq!(g[0].sum_ns, 61_000);
    sums[4] = 91_500;
    rows[4][hist_slot(30_500)] += 1;
    counts[4] = 3;
    let g = s.take(&rows, &counts, |i| sums[i]);
    assert_eq!(g[0].sum_ns, 30_500);
    assert_eq!(g[0].slots.iter().map(|x| x.1).sum::<u64>(), 1);
    assert!(s.take(&rows, &counts, |i| sums[i]).is_empty());
}
