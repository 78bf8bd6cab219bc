//! Tests of stats.rs.
use super::*;
use hdrhistogram::Histogram;
use proptest::prelude::*;

fn hdr() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_HIGH_NS, HIST_SIGFIG).unwrap()
}

#[test]
fn a_stage_hist_allocates_only_the_powers_of_two_it_counts() {
    let mut h = StageHist::new();
    let chunks = |h: &StageHist| h.chunks.iter().filter(|c| c.is_some()).count();
    assert_eq!(chunks(&h), 0);
    for ns in [40_000u64, 50_000, 60_000, 65_000] {
        h.record(ns);
    }
    assert_eq!(chunks(&h), 1);
    h.record(1_000_000);
    h.record(u64::MAX);
    assert_eq!(chunks(&h), 3);
    let mut m = StageHist::new();
    m.add(&h);
    assert_eq!((chunks(&m), m.summary()), (3, h.summary()));
}

#[test]
fn counts_by_slot_equal_recorded_values() {
    let values = [0u64, 1, 255, 256, 300, 4_000, 65_537, 1 << 33, u64::MAX];
    let (mut each, mut slots) = (Aggregator::new(), Aggregator::new());
    let mut by_slot: Vec<(usize, u64)> = Vec::new();
    for v in values {
        each.record("syscalls", "pread64", v);
        by_slot.push((hist_slot(v), 1));
    }
    let sum: u128 = values.iter().map(|&v| u128::from(v)).sum();
    slots.record_slots("syscalls", "pread64", &by_slot, sum);
    assert_eq!(each.summaries(), slots.summaries());
    assert_eq!(each.render_table("t"), slots.render_table("t"));
    assert_eq!(hist_slot(u64::MAX), hist_slot(HIST_HIGH_NS));
}

#[test]
fn stage_hist_layout_is_hdrhistograms() {
    let h = hdr();
    assert_eq!(h.distinct_values(), HIST_LEN);
    let mut v = 1u64;
    while v < HIST_HIGH_NS {
        for x in [v, v + 1, v * 3 / 2, (v * 2).saturating_sub(1)] {
            assert_eq!(hist_value(hist_index(x)), h.lowest_equivalent(x), "{x}");
        }
        v *= 2;
    }
    assert!(hist_index(HIST_HIGH_NS) < HIST_LEN);
    assert!(hist_index(u64::MAX) >= HIST_LEN);
}

proptest! {
    /// Same count, mean and quantiles as recording into the HDR histogram
    /// (also when merged, and for values beyond its range).
    #[test]
    fn stage_hist_summary_is_hdrhistograms(
        a in prop::collection::vec(prop_oneof![0u64..5_000_000, any::<u64>()], 0..300),
        b in prop::collection::vec(0u64..50_000_000_000, 0..300),
    ) {
        let (mut x, mut y) = (StageHist::new(), StageHist::new());
        let mut h = hdr();
        let mut sum = 0u128;
        for &v in &a {
            x.record(v);
            h.saturating_record(v.max(1));
            sum += u128::from(v);
        }
        for &v in &b {
            y.record(v);
            h.saturating_record(v.max(1));
            sum += u128::from(v);
        }
        x.add(&y);
        let n = h.len();
        let want = Summary {
            count: n,
            mean_ns: if n == 0 { 0 } else { (sum / u128::from(n)) as u64 },
            p50_ns: h.value_at_quantile(0.5),
            p99_ns: h.value_at_quantile(0.99),
            max_ns: h.max(),
        };
        prop_assert_eq!(x.summary(), want);
    }
}

fn pts(v: &[(Point, u64)]) -> Points {
    v.iter().copied().collect()
}

#[test]
fn pair_label_follows_the_pair() {
    let mut l = PairLabel::default();
    assert_eq!(l.get("vm1", "vda"), "vm1/vda");
    assert_eq!(l.get("vm1", "vda"), "vm1/vda");
    assert_eq!(l.get("vm1", "vdb"), "vm1/vdb");
    assert_eq!(l.get("vm2", "vdb"), "vm2/vdb");
    assert_eq!(l.get("vm", "2/vdb"), "vm/2/vdb");
}

#[test]
fn record_points_uses_the_partition_names() {
    let p = pts(&[
        (Point::RqIssue, 300),
        (Point::QueueRq, 250),
        (Point::BioQueue, 100),
        (Point::Kick, 400),
        (Point::Irq, 900),
        (Point::RqComplete, 1300),
    ]);
    let mut a = Aggregator::new();
    a.record_points("vda", &p);
    let got: Vec<(String, u64)> = a
        .summaries()
        .into_iter()
        .map(|s| (s.stage, s.summary.max_ns))
        .collect();
    let want = [
        ("guest_queue", 200),
        ("guest_driver", 100),
        ("device", 500),
        ("guest_complete", 400),
        ("total", 1200),
    ];
    assert_eq!(got.len(), want.len(), "{got:?}");
    for ((g, gns), (w, wns)) in got.iter().zip(want) {
        assert_eq!(g, w);
        // HDR histograms keep 2 significant digits.
        assert!(gns.abs_diff(wns) * 100 <= wns, "{g}: {gns} vs {wns}");
    }
}

#[test]
fn aggregator_summarises_per_label_and_stage() {
    let mut a = Aggregator::new();
    for i in 1..=100u64 {
        a.record("vda", "x", i * 1000);
    }
    a.record("vdb", "y", 5);
    let s = a.get("vda", "x").unwrap();
    assert_eq!(s.count, 100);
    assert_eq!(s.mean_ns, 50_500);
    assert!((49_000..=51_000).contains(&s.p50_ns), "{s:?}");
    assert!((98_000..=100_500).contains(&s.p99_ns), "{s:?}");
    assert!((99_000..=101_000).contains(&s.max_ns), "{s:?}");
    assert_eq!(a.get("vdb", "y").unwrap().count, 1);
    assert!(a.get("vdb", "x").is_none());
    let t = a.render_table("interval");
    assert!(t.contains("vda") && t.contains("vdb") && t.contains("100"));
    let mut b = Aggregator::new();
    b.merge(&a);
    b.merge(&a);
    assert_eq!(b.get("vda", "x").unwrap().count, 200);
    a.clear();
    assert!(a.is_empty());
    assert!(a.render_table("t").contains("no I/O"));
}

/// Each value lands under its own label while labels come and go: new ones
/// sort in before the one used last, and a clear forgets them all.
#[test]
fn labels_keep_their_values_as_new_ones_sort_in() {
    let mut a = Aggregator::new();
    let order = [
        "vdc", "vdc", "vda", "vdc", "vdb", "vdb", "vda", "syscalls", "vdc",
    ];
    for (i, l) in order.iter().enumerate() {
        a.record(l, "x", 1000 * (i as u64 + 1));
    }
    for l in ["vda", "vdb", "vdc", "syscalls"] {
        let want = order.iter().filter(|&&o| o == l).count() as u64;
        assert_eq!(a.get(l, "x").unwrap().count, want, "{l}");
    }
    a.clear();
    a.record("vdz", "x", 1);
    assert_eq!(a.get("vdz", "x").unwrap().count, 1);
    assert!(a.get("vdc", "x").is_none());
}

/// Two labels in turn (a disk's requests, the syscalls that made them) and
/// stages by name in runs, while new labels sort in before the remembered
/// ones: every value lands under its own label and stage.
#[test]
fn alternating_labels_and_named_stages_keep_their_values() {
    let mut a = Aggregator::new();
    let order = [
        ("vdc", "io_submit"),
        ("syscalls", "io_submit"),
        ("vdc", "io_submit"),
        ("syscalls", "pread64"),
        ("vda", "total"),
        ("syscalls", "io_submit"),
        ("vdb", "io_submit"),
        ("syscalls", "pread64"),
        ("vdb", "total"),
        ("aaa", "x"),
        ("syscalls", "io_submit"),
        ("vdc", "total"),
        ("vdc", "io_submit"),
    ];
    for (i, (l, st)) in order.iter().enumerate() {
        a.record(l, st, 1000 * (i as u64 + 1));
    }
    for &(l, st) in &order {
        let want = order.iter().filter(|&&o| o == (l, st)).count() as u64;
        assert_eq!(a.get(l, st).unwrap().count, want, "{l} {st}");
    }
    // the names only where they were recorded
    assert!(a.get("vda", "io_submit").is_none() && a.get("aaa", "total").is_none());
}

#[test]
fn table_rows_follow_path_order_with_total_last() {
    let mut a = Aggregator::new();
    a.record("vda", "total", 9);
    a.record("vda", "guest_complete", 5);
    a.record("vda", "custom", 1);
    a.record("vda", "device", 3);
    a.record("vda", "guest_queue+guest_driver", 2);
    let t = a.render_table("t");
    let pos = |s: &str| t.find(s).unwrap();
    assert!(pos("guest_queue+guest_driver") < pos("device"));
    assert!(pos("device") < pos("guest_complete"));
    assert!(pos("guest_complete") < pos("custom"));
    assert!(pos("custom") < pos("total"));
}

#[test]
fn record_points_feeds_stages_and_total() {
    let mut a = Aggregator::new();
    a.record_points(
        "h",
        &pts(&[(Point::HostSubmit, 10), (Point::HostIoComplete, 40)]),
    );
    assert_eq!(a.get("h", "host_io").unwrap().count, 1);
    assert_eq!(a.get("h", "total").unwrap().max_ns, 30);
}

/// The per-record path (stage ids from the points) makes the same
/// statistics as recording each record's derived, named stages: joined
/// records of a synthetic stream, with some points dropped so that stand-ins
/// and merged stages occur, under two labels, drained into totals.
#[test]
fn recording_points_equals_recording_derived_stages() {
    use crate::join::synth::{generate, interleave, Event, SynthConfig};
    let s = generate(&SynthConfig {
        requests: 3000,
        queues: 2,
        seed: 5,
        ..SynthConfig::default()
    });
    let mut e = crate::join::JoinEngine::default();
    let mut out = Vec::new();
    for ev in interleave(&s, 1_000_000, 100, 9) {
        match ev {
            Event::Guest(g) => e.push_guest("vm0", g, &mut out),
            Event::Host(h) => e.push_host(h, &mut out),
            Event::Probe(a, b, c, d) => {
                let _ = e.clock("vm0").add_guest_probe(a, b, c, d);
            }
        }
    }
    e.flush(&mut out);
    let drop = [
        Point::RqIssue,
        Point::HostPop,
        Point::HostCompleteCb,
        Point::Irq,
    ];
    let (mut by_ids, mut by_names) = (Aggregator::new(), Aggregator::new());
    let (mut ids_total, mut names_total) = (Aggregator::new(), Aggregator::new());
    for (k, j) in out.iter_mut().enumerate() {
        if k % 3 == 0 {
            j.ts.remove(drop[k % drop.len()]);
        }
        let bd = crate::stages::derive(&j.ts);
        let label = if k % 2 == 0 { "vm0/vda" } else { "vm0/vdb" };
        // a label of its own for negative (cross-clock) stages
        let label = if bd.stages.iter().any(|s| s.1 < 0) {
            "neg"
        } else {
            label
        };
        assert_eq!(by_ids.record_points(label, &j.ts), bd.total_ns);
        by_names.record_breakdown(label, &bd);
        if k % 500 == 0 {
            by_ids.drain_into(&mut ids_total);
            by_names.drain_into(&mut names_total);
        }
    }
    by_ids.drain_into(&mut ids_total);
    by_names.drain_into(&mut names_total);
    assert_eq!(ids_total.summaries(), names_total.summaries());
    assert_eq!(ids_total.render_table("t"), names_total.render_table("t"));
    let stages = ids_total.summaries().len();
    assert!(stages > 12, "merged stages and stand-ins occur: {stages}");
}

#[test]
fn records_with_different_stage_sets_keep_each_stage_apart() {
    // The lookup hint (the slot after the previous stage) must not mix up
    // stages when a record skips one or brings a new one.
    let mut a = Aggregator::new();
    let full = pts(&[
        (Point::RqIssue, 100),
        (Point::VqAdd, 150),
        (Point::RqComplete, 400),
    ]);
    let short = pts(&[(Point::RqIssue, 100), (Point::RqComplete, 300)]);
    for _ in 0..3 {
        a.record_points("vda", &full);
        a.record_points("vda", &short);
    }
    let stages = |a: &Aggregator| {
        a.summaries()
            .into_iter()
            .map(|s| (s.stage, s.summary.count))
            .collect::<Vec<_>>()
    };
    let got = stages(&a);
    let total = got.iter().find(|(s, _)| s == TOTAL_STAGE).map(|x| x.1);
    assert_eq!(total, Some(6), "{got:?}");
    // every stage name appears once, and the counts add up per record kind
    let mut names: Vec<&str> = got.iter().map(|(s, _)| s.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), got.len(), "{got:?}");
    assert!(got.iter().all(|(_, n)| *n == 3 || *n == 6), "{got:?}");
}

#[test]
fn totals_from_drained_intervals_equal_recording_every_value_twice() {
    let mut direct = Aggregator::new();
    let (mut interval, mut total) = (Aggregator::new(), Aggregator::new());
    for i in 1..=1000u64 {
        let stage = if i % 3 == 0 { "host_io" } else { "guest_queue" };
        direct.record("vm/vda", stage, i * 7);
        interval.record("vm/vda", stage, i * 7);
        if i % 250 == 0 {
            interval.drain_into(&mut total);
            assert!(interval.is_empty());
        }
    }
    interval.record("vm/vdb", "total", 5);
    direct.record("vm/vdb", "total", 5);
    interval.drain_into(&mut total);
    assert_eq!(total.summaries(), direct.summaries());
}

#[test]
fn waterfall_lists_points_in_time_order() {
    let w = render_waterfall(
        "pid 1 x",
        &pts(&[(Point::RqComplete, 5_000_000), (Point::RqIssue, 1_000_000)]),
    );
    let lines: Vec<&str> = w.lines().collect();
    assert!(lines[0].starts_with("pid 1 x") && lines[0].contains("4.00ms"));
    assert!(lines[1].contains("g.rq_issue"));
    assert!(lines[2].contains("g.rq_complete") && lines[2].contains("(+4.00ms)"));
    assert!(render_waterfall("h", &Points::new()).contains("no points"));
}

#[test]
fn fmt_ns_units() {
    assert_eq!(fmt_ns(999), "999ns");
    assert_eq!(fmt_ns(12_345), "12.3us");
    assert_eq!(fmt_ns(4_560_000), "4.56ms");
    assert_eq!(fmt_ns(1_200_000_000), "1.20s");
}
