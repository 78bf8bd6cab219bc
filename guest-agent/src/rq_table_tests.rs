use super::*;

/// The C side's `ts[]` slots (P_SYSCALL_ENTER …), as raw.rs maps them.
fn c_points() -> Vec<Option<Point>> {
    crate::raw::point_slots()
}

fn mask_of(points: &[Point]) -> u32 {
    let c = c_points();
    points
        .iter()
        .map(|p| 1 << c.iter().position(|q| *q == Some(*p)).expect("a C slot"))
        .sum()
}

const FULL: [Point; 10] = [
    Point::SyscallEnter,
    Point::BioQueue,
    Point::RqInsert,
    Point::QueueRq,
    Point::RqIssue,
    Point::VqAdd,
    Point::Kick,
    Point::Irq,
    Point::DriverComplete,
    Point::RqComplete,
];

fn plan_of(w: &Write) -> (u32, rq_plan) {
    let Write::Plan { key, value } = w else {
        panic!("not a plan: {w:?}")
    };
    let n = plan_steps();
    assert_eq!(value.len(), 1 + 3 * n);
    let mut p = rq_plan {
        n: value[0],
        ..Default::default()
    };
    p.from.copy_from_slice(&value[1..1 + n]);
    p.to.copy_from_slice(&value[1 + n..1 + 2 * n]);
    p.row.copy_from_slice(&value[1 + 2 * n..]);
    (*key, p)
}

#[test]
fn the_sizes_are_the_c_sides() {
    assert_eq!(plan_steps(), 8);
    assert_eq!(row_slots(), 2560);
    assert_eq!(std::mem::size_of::<rq_plan>(), 25);
    assert_eq!(c_points().len(), P_NR as usize);
}

#[test]
fn a_new_disk_and_mask_get_a_plan_of_the_counted_stages() {
    let mut t = RqTable::new(&c_points());
    let mask = mask_of(&FULL);
    let w = t.learn(0x0fc0_0010, mask, format!("d{}", 0x0fc0_0010));
    assert_eq!(w.len(), 2, "{w:?}");
    let mut devs = vec![0u8; 16];
    devs[..4].copy_from_slice(&0x0fc0_0010u32.to_ne_bytes());
    assert_eq!(w[0], Write::Disks(devs));
    let (key, p) = plan_of(&w[1]);
    assert_eq!(key, mask);
    // The statistics' stages of such a record, in C slots, one row each.
    let c = c_points();
    let slot = |pt: Point| c.iter().position(|q| *q == Some(pt)).unwrap() as u8;
    let want = [
        (Point::SyscallEnter, Point::BioQueue),
        (Point::BioQueue, Point::RqIssue),
        (Point::RqIssue, Point::Kick),
        (Point::Kick, Point::Irq),
        (Point::Irq, Point::RqComplete),
        (Point::SyscallEnter, Point::RqComplete),
    ];
    assert_eq!(usize::from(p.n), want.len());
    for (i, (a, b)) in want.iter().enumerate() {
        assert_eq!(
            (p.from[i], p.to[i], p.row[i]),
            (slot(*a), slot(*b), i as u8 + 1)
        );
    }
    // Known now: nothing more to write.
    assert!(t
        .learn(0x0fc0_0010, mask, format!("d{}", 0x0fc0_0010))
        .is_empty());
}

#[test]
fn a_second_mask_shares_the_disks_rows_and_a_second_disk_gets_its_own() {
    let mut t = RqTable::new(&c_points());
    t.learn(7, mask_of(&FULL), format!("d{}", 7));
    // Without g.kick: g.vq_add stands in, the same stages and rows.
    let no_kick: Vec<Point> = FULL.iter().copied().filter(|p| *p != Point::Kick).collect();
    let w = t.learn(7, mask_of(&no_kick), format!("d{}", 7));
    assert_eq!(w.len(), 1);
    let (key, p) = plan_of(&w[0]);
    assert_eq!(key, mask_of(&no_kick));
    assert_eq!(&p.row[..6], &[1, 2, 3, 4, 5, 6]);
    // Another disk: index 1, rows 7…
    let w = t.learn(9, mask_of(&FULL), format!("d{}", 9));
    let (key, p) = plan_of(&w[1]);
    assert_eq!(key, 1 << P_NR | mask_of(&FULL));
    assert_eq!(&p.row[..6], &[7, 8, 9, 10, 11, 12]);
}

#[test]
fn past_the_disks_or_rows_the_records_keep_coming() {
    let mut t = RqTable::new(&c_points());
    for dev in 1..=DISKS as u32 {
        assert_eq!(t.learn(dev, mask_of(&FULL), format!("d{}", dev)).len(), 2);
    }
    // A fifth disk: refused, no write.
    assert!(t.learn(99, mask_of(&FULL), format!("d{}", 99)).is_empty());
    assert_eq!(t.refused, 1);
    // Rows: 4 disks × 6 = 24 of 32; other sets of points name other stages
    // (merges), until no row is left: then refused, never past the rows.
    let sets = [
        mask_of(&[Point::RqIssue, Point::VqAdd, Point::RqComplete]),
        mask_of(&[Point::BioQueue, Point::Irq]),
        mask_of(&[Point::SyscallEnter, Point::RqComplete]),
    ];
    for m in sets {
        for dev in 1..=DISKS as u32 {
            t.learn(dev, m, format!("d{dev}"));
        }
    }
    assert_eq!(t.rows.len(), ROWS);
    assert!(t.refused > 1, "{}", t.refused);
    // A mask of no point at all, or beyond the slots: nothing.
    assert!(t.learn(1, 0, format!("d{}", 1)).is_empty());
    assert!(t.learn(1, 1 << P_NR, format!("d{}", 1)).is_empty());
}

fn row_bytes(sum: u64, counts: &[(usize, u32)]) -> Vec<u8> {
    let mut v = sum.to_ne_bytes().to_vec();
    let mut c = vec![0u32; row_slots()];
    for &(s, n) in counts {
        c[s] = n;
    }
    v.extend(c.iter().flat_map(|x| x.to_ne_bytes()));
    v
}

#[test]
fn take_hands_on_what_each_row_gained() {
    let mut t = RqTable::new(&c_points());
    t.learn(7, mask_of(&FULL), format!("d{}", 7));
    t.learn(9, mask_of(&FULL), format!("d{}", 9));
    let rows = std::cell::RefCell::new(vec![row_bytes(0, &[]); ROWS]);
    rows.borrow_mut()[0] = row_bytes(3000, &[(900, 2), (1000, 1)]);
    let read = |r: u32| Some(rows.borrow()[r as usize].clone());
    let (n, g) = t.take(&[3, 0, 0, 0], read);
    assert_eq!(n, 3);
    assert_eq!(
        g,
        vec![Gain {
            disk: "d7".into(),
            stage: "guest_fs",
            slots: vec![(900, 2), (1000, 1)],
            sum_ns: 3000
        }]
    );
    // Disk 0 did not move: its rows are not read; disk 1's are.
    rows.borrow_mut()[0] = row_bytes(9999, &[(900, 5)]);
    rows.borrow_mut()[7] = row_bytes(50, &[(10, 1)]);
    let (n, g) = t.take(&[3, 1, 0, 0], read);
    assert_eq!(n, 1);
    assert_eq!(g.len(), 1);
    assert_eq!(
        (g[0].disk.as_str(), g[0].stage, g[0].sum_ns),
        ("d9", "guest_queue", 50)
    );
    // Now disk 0 moved: the difference, a wrapped 32-bit count included.
    rows.borrow_mut()[0] = row_bytes(10_000, &[(900, 5), (1000, 1), (5, u32::MAX)]);
    let (_, g) = t.take(&[4, 1, 0, 0], read);
    let mut slots = g[0].slots.clone();
    slots.sort();
    assert_eq!(slots, vec![(5, u64::from(u32::MAX)), (900, 3)]);
    assert_eq!(g[0].sum_ns, 7000);
    rows.borrow_mut()[0] = row_bytes(10_001, &[(900, 5), (1000, 1), (5, 1)]);
    let (_, g) = t.take(&[5, 1, 0, 0], read);
    assert_eq!(g[0].slots, vec![(5, 2)]);
    // A short row is not believed.
    let (_, g) = t.take(&[6, 1, 0, 0], |_| Some(vec![0; 8]));
    assert!(g.is_empty());
}
