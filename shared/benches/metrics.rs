//! Cost of the fleet outputs on the per-record path: what the host agent does
//! for each joined record when `--metrics-listen`/`--otlp` are on (a series
//! lookup in the recorder's cache and one histogram update per stage), and what
//! a scrape costs (paid only when someone scrapes).
//!
//! `cargo bench -p viotrace-shared --bench metrics` (budget: ≤ 0.2 µs per record).

use std::borrow::Cow;
use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use viotrace_shared::join::host_breakdown;
use viotrace_shared::metrics::{expose, Metrics, Recorder};
use viotrace_shared::record::{Backend, HostElem, Op, Point};
use viotrace_shared::stages::{Stages, STAGE_NAMES};

fn joined_stages() -> Stages {
    Stages(
        STAGE_NAMES
            .iter()
            .enumerate()
            .map(|(i, n)| (Cow::Borrowed(*n), 1_000 + 7_919 * i as i64))
            .collect(),
    )
}

fn per_record(c: &mut Criterion) {
    let m = Metrics::new("bench");
    let mut r = Recorder::new(m.clone());
    let st = joined_stages();
    let mut g = c.benchmark_group("metrics");
    g.throughput(Throughput::Elements(1));
    let mut i = 0u16;
    g.bench_function("record_joined_10_stages_4_queues", |b| {
        b.iter(|| {
            i = i.wrapping_add(1);
            r.record(
                "joined",
                black_box("vm-0123"),
                black_box("vdb"),
                Some(i & 3),
                Op::Read,
                4096,
                black_box(&st),
                Some(100_000),
                true,
            );
        })
    });
    // The host agent's own view: its element's stages derived, then recorded.
    let el = HostElem {
        vm: "vm-0123".into(),
        time: None,
        qemu_pid: 1,
        device: "virtio-disk1".into(),
        queue: 0,
        head: 3,
        op: Op::Read,
        sector: 8,
        bytes: 4096,
        backend: Backend::Threads,
        merge_id: 1,
        status: Some(0),
        ts: [
            (Point::HostNotify, 1_000),
            (Point::HostPop, 2_000),
            (Point::HostSubmit, 3_000),
            (Point::HostIoIssue, 4_000),
            (Point::HostIoComplete, 90_000),
            (Point::HostCompleteCb, 91_000),
            (Point::HostPush, 92_000),
            (Point::HostIrq, 93_000),
        ]
        .into_iter()
        .collect(),
        interference: None,
    };
    g.bench_function("record_host_elem_with_derive", |b| {
        b.iter(|| {
            let bd = host_breakdown(black_box(&el));
            r.record(
                "host",
                &el.vm,
                &el.device,
                Some(el.queue),
                el.op,
                el.bytes,
                &bd.stages,
                bd.total_ns,
                true,
            );
        })
    });
    g.bench_function("scrape_render_4_series", |b| {
        b.iter(|| black_box(expose::render(&m).len()))
    });
    g.finish();
}

criterion_group!(benches, per_record);
criterion_main!(benches);
