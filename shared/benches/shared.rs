//! Benchmarks of the shared crate's hot paths:
//! * join engine throughput on realistic synthetic streams (several queues,
//!   head reuse, guest batching and QEMU merges, out-of-order arrival);
//! * the joined host agent's whole per-I/O path, replayed (see [`bench_host_path`]);
//! * wire frame encode/decode throughput;
//! * clock estimator update and lookup cost;
//! * guest sender throughput over a Unix socket.
//!
//! `cargo bench -p viotrace-shared` (add `-- --quick` for a short run).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use viotrace_shared::clock::ClockEstimator;
use viotrace_shared::join::synth::{generate, interleave, Event, SynthConfig};
use viotrace_shared::join::{Emitted, JoinEngine, Output};
use viotrace_shared::jsonl::JsonLines;
use viotrace_shared::proto::{
    batch_frame, encode_frame_into, rq_bpf, BatchReader, FrameDecoder, GuestRecord, GuestRecordRef,
    Inbound, Message,
};
use viotrace_shared::record::{HostElem, Point};
use viotrace_shared::stats::{Aggregator, PairLabel};

fn feed(events: Vec<Event>) -> usize {
    let mut e = JoinEngine::default();
    let mut out = Vec::with_capacity(1024);
    let mut n = 0;
    for ev in events {
        match ev {
            Event::Guest(g) => e.push_guest("vm0", g, &mut out),
            Event::Host(h) => e.push_host(h, &mut out),
            Event::Probe(a, b, c, d) => {
                let _ = e.clock("vm0").add_guest_probe(a, b, c, d);
            }
        }
        if out.len() >= 1024 {
            n += out.len();
            out.clear();
        }
    }
    e.flush(&mut out);
    n + out.len()
}

fn thread_cpu_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .expect("thread CPU clock");
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}

fn bench_join(c: &mut Criterion) {
    let mut g = c.benchmark_group("join");
    g.measurement_time(Duration::from_secs(5));
    g.sample_size(10);
    let n = 100_000;
    for (name, cfg) in [
        (
            "4q_reuse",
            SynthConfig {
                requests: n,
                queues: 4,
                interval_ns: 20_000,
                ..SynthConfig::default()
            },
        ),
        (
            "4q_batch4_merged",
            SynthConfig {
                requests: n,
                queues: 4,
                interval_ns: 20_000,
                batch: 4,
                merge: true,
                ..SynthConfig::default()
            },
        ),
        (
            "1q_no_clock_few_sectors",
            SynthConfig {
                requests: n,
                queues: 1,
                blocks: 64,
                probe_every_ns: 0,
                interval_ns: 50_000,
                ..SynthConfig::default()
            },
        ),
    ] {
        let s = generate(&cfg);
        let events = interleave(&s, 2_000_000, n / 10, 7);
        let records = (s.guest.len() + s.host.len()) as u64;
        // The machine is shared: also report records per *CPU* second of this
        // thread, which other processes' load does not dilute.
        // Best of 5 passes (the least disturbed by other processes).
        let mut cpu = u64::MAX;
        let mut emitted = 0;
        for _ in 0..5 {
            let ev = events.clone();
            let c0 = thread_cpu_ns();
            emitted = feed(ev);
            cpu = cpu.min(thread_cpu_ns() - c0);
        }
        eprintln!(
            "join/{name}: {records} records ({emitted} outputs) in {:.1} ms CPU (best of 5) = {:.2} M records/CPU-s",
            cpu as f64 / 1e6,
            records as f64 / (cpu as f64 / 1e9) / 1e6
        );
        g.throughput(Throughput::Elements(records));
        g.bench_function(name, |b| {
            b.iter_batched(
                || events.clone(),
                |ev| black_box(feed(ev)),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

fn bench_proto(c: &mut Criterion) {
    let s = generate(&SynthConfig {
        requests: 1024,
        ..SynthConfig::default()
    });
    let msg = Message::Batch {
        first_seq: 0,
        records: s.guest.iter().cloned().map(GuestRecord::Rq).collect(),
    };
    let mut frame = Vec::new();
    encode_frame_into(&msg, &mut frame).unwrap();
    let mut g = c.benchmark_group("proto");
    g.measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(1024));
    g.bench_function("encode_batch_1024_rq", |b| {
        let mut out = Vec::with_capacity(frame.len());
        b.iter(|| {
            out.clear();
            encode_frame_into(black_box(&msg), &mut out).unwrap();
            black_box(out.len())
        })
    });
    g.bench_function("decode_batch_1024_rq", |b| {
        b.iter(|| {
            let mut d = FrameDecoder::new();
            // Arrives in 16 KiB reads.
            let mut n = 0;
            for chunk in frame.chunks(16 * 1024) {
                d.feed(chunk);
                while let Some(m) = d.next_message().unwrap() {
                    if let Message::Batch { records, .. } = m {
                        n += records.len();
                    }
                }
            }
            black_box(n)
        })
    });
    // The guest agent's form since protocol 8: the BPF layout, as copied.
    let mut entries = Vec::new();
    for r in &s.guest {
        rq_bpf::entry_of(r, &mut entries);
    }
    let mut bpf_frame = Vec::new();
    batch_frame(0, s.guest.len(), [&entries[..]], &mut bpf_frame);
    g.bench_function("decode_batch_1024_rq_bpf", |b| {
        let mut reader = BatchReader::new();
        b.iter(|| {
            let mut d = FrameDecoder::new();
            let mut n = 0;
            for chunk in bpf_frame.chunks(16 * 1024) {
                d.feed(chunk);
                while let Some(Inbound::Batch(batch)) = d.next_inbound().unwrap() {
                    reader.read(&batch, |r| n += usize::from(r.is_ok()));
                }
            }
            black_box(n)
        })
    });
    g.throughput(Throughput::Bytes(frame.len() as u64));
    g.bench_function("decode_batch_bytes", |b| {
        b.iter(|| {
            let mut d = FrameDecoder::new();
            d.feed(&frame);
            black_box(d.next_message().unwrap().is_some())
        })
    });
    g.finish();
}

fn bench_clock(c: &mut Criterion) {
    let s = generate(&SynthConfig {
        requests: 20_000,
        probe_every_ns: 100_000_000,
        ..SynthConfig::default()
    });
    let mut warm = ClockEstimator::default();
    for &(a, b, c2, d) in &s.probes {
        let _ = warm.add_guest_probe(a, b, c2, d);
    }
    let last = s.probes.last().map(|p| p.0).unwrap_or(0);
    let mut g = c.benchmark_group("clock");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("offset_at_cached", |b| {
        let mut e = warm.clone();
        let mut t = last;
        b.iter(|| {
            t += 1000;
            black_box(e.offset_at(black_box(t)))
        })
    });
    g.bench_function("probe_update_and_refit", |b| {
        let mut e = warm.clone();
        let mut t = last;
        b.iter(|| {
            // A new, better sample every time: forces a refit.
            t += 1_000_000_000;
            let _ = e.add_guest_probe(t, t + 5_000_000_010, t + 5_000_000_011, t + 20);
            black_box(e.offset_at(t))
        })
    });
    g.bench_function("request_sample_update", |b| {
        let mut e = warm.clone();
        let mut t = last;
        b.iter(|| {
            t += 10_000;
            let _ = e.add_request(t, t + 5_000_050_000, t + 5_000_150_000, t + 200_000);
            black_box(e.offset_at(t))
        })
    });
    g.finish();
}

/// Guest sender → Unix socket → a reader that decodes frames: records per second.
fn bench_transport(c: &mut Criterion) {
    use std::io::Read;
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use viotrace_shared::proto::{write_message, HelloAck, PROTOCOL_VERSION};
    use viotrace_shared::transport::{local_hello, Endpoint, GuestSender, GuestSenderConfig};

    let path = std::env::temp_dir().join(format!("viotrace-bench-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let lis = UnixListener::bind(&path).unwrap();
    let got = Arc::new(AtomicU64::new(0));
    let got2 = got.clone();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = lis.accept().unwrap();
        let mut d = FrameDecoder::new();
        let mut buf = vec![0u8; 256 * 1024];
        let mut acked = false;
        loop {
            let n = match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            d.feed(&buf[..n]);
            while let Ok(Some(m)) = d.next_message() {
                match m {
                    Message::Hello(_) if !acked => {
                        acked = true;
                        write_message(
                            &mut s,
                            &Message::HelloAck(HelloAck {
                                protocol_version: PROTOCOL_VERSION,
                                agent_version: "bench".into(),
                                vm: "vm".into(),
                                resume: None,
                            }),
                        )
                        .unwrap();
                    }
                    Message::Batch { first_seq, records } => {
                        got2.fetch_add(records.len() as u64, Ordering::Relaxed);
                        let next_seq = first_seq + records.len() as u64;
                        write_message(&mut s, &Message::Ack { next_seq }).unwrap();
                    }
                    Message::Bye { .. } => return,
                    _ => {}
                }
            }
        }
    });
    let mut cfg = GuestSenderConfig::new(Endpoint::Unix(path.clone()), local_hello("bench", None));
    cfg.flush_interval = Duration::from_millis(1);
    cfg.max_buffered = 1 << 20;
    let sender = GuestSender::start(cfg).unwrap();
    let s = generate(&SynthConfig {
        requests: 10_000,
        ..SynthConfig::default()
    });
    let mut g = c.benchmark_group("transport");
    g.measurement_time(Duration::from_secs(3));
    g.sample_size(10);
    g.throughput(Throughput::Elements(s.guest.len() as u64));
    g.bench_function("guest_sender_unix_10k_rq", |b| {
        b.iter_batched(
            || s.guest.clone(),
            |recs| {
                let target = got.load(Ordering::Relaxed) + recs.len() as u64;
                for r in recs {
                    sender.send_rq(&r);
                }
                while got.load(Ordering::Relaxed) < target {
                    std::thread::yield_now();
                }
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
    let st = sender.shutdown("bench done", Duration::from_secs(5));
    assert_eq!(st.lost(), 0);
    let _ = reader.join();
    let _ = std::fs::remove_file(&path);
}

/// One input of the joined host agent, in the order it receives them.
/// (Inline, as the agent keeps its elements.)
#[derive(Clone)]
#[allow(clippy::large_enum_variant)]
enum HostInput {
    /// A host element from the BPF ring buffer.
    Elem(HostElem),
    /// A batch frame of guest records, as the guest's uplink sends it.
    Frame(Vec<u8>),
    Probe(u64, u64, u64, u64),
}

/// Guest flush period (the uplink's default `flush_interval`) and batch cap.
const GUEST_FLUSH_NS: u64 = 100_000_000;
const GUEST_BATCH_MAX: usize = 1024;

/// A QD32-like stream as the joined host agent receives it: host elements at
/// their last point, guest records 0.5 ms after their completion batched into
/// one frame per 100 ms of the guest's uplink (at most 1024 records), probes
/// once a second.
fn host_inputs(requests: usize, interval_ns: u64) -> (Vec<HostInput>, usize) {
    let s = generate(&SynthConfig {
        requests,
        queues: 2,
        interval_ns,
        service_ns: (200_000, 2_000_000),
        probe_every_ns: 1_000_000_000,
        ..SynthConfig::default()
    });
    // (arrival, order, input): order keeps the guest's own order within a time.
    let mut ev: Vec<(u64, usize, HostInput)> = Vec::new();
    for h in &s.host {
        let at = h.ts.iter().map(|e| e.1).max().unwrap_or(0);
        ev.push((at, 0, HostInput::Elem(h.clone())));
    }
    let mut guest: Vec<(u64, GuestRecord)> = s
        .guest
        .iter()
        .map(|g| {
            let done = g.ts.get(Point::RqComplete).unwrap_or(0);
            (s.host_of(done) + 500_000, GuestRecord::Rq(g.clone()))
        })
        .collect();
    guest.sort_by_key(|g| g.0);
    let mut first_seq = 0;
    let mut frames = 0;
    for chunk in guest.chunk_by(|a, b| a.0 / GUEST_FLUSH_NS == b.0 / GUEST_FLUSH_NS) {
        for part in chunk.chunks(GUEST_BATCH_MAX) {
            // (as the guest agent sends them: in the BPF layout)
            let mut entries = Vec::new();
            for g in part {
                let GuestRecord::Rq(r) = &g.1 else {
                    unreachable!("request records only")
                };
                rq_bpf::entry_of(r, &mut entries);
            }
            let n = part.len() as u64;
            let mut frame = Vec::new();
            batch_frame(first_seq, part.len(), [&entries[..]], &mut frame);
            first_seq += n;
            let at = (part[0].0 / GUEST_FLUSH_NS + 1) * GUEST_FLUSH_NS;
            ev.push((at, 1 + frames, HostInput::Frame(frame)));
            frames += 1;
        }
    }
    for &(t1, t2, t3, t4) in &s.probes {
        ev.push((s.host_of(t4), 0, HostInput::Probe(t1, t2, t3, t4)));
    }
    ev.sort_by_key(|e| (e.0, e.1));
    (ev.into_iter().map(|e| e.2).collect(), s.guest.len())
}

/// What the joined host agent does per record without `-t`, metrics or
/// `--json` (as in `viotrace-vm bench`): the host elements' table, the join,
/// the joined records' table and the always-on output (1 in 1000 written).
struct HostPath {
    engine: JoinEngine,
    decoder: FrameDecoder,
    reader: BatchReader,
    elems: Aggregator,
    elem_label: PairLabel,
    out: Written,
}

/// The join's records, handled as they come, as the agent does
/// (`joined::Outputs`): statistics from the view, the record built only
/// when written.
struct Written {
    joined: Aggregator,
    label: PairLabel,
    file: JsonLines<std::io::Sink>,
    offered: u64,
    written: u64,
}

impl Output for Written {
    fn emit(&mut self, r: Emitted<'_>) {
        if r.joined() {
            let disk = r.disk().or(r.device()).unwrap_or("?");
            let label = self.label.get(r.vm(), disk);
            self.joined.record_points(label, r.ts());
        }
        self.offered += 1;
        if self.offered.is_multiple_of(1000) {
            self.written += 1;
            let _ = self.file.write(&r.build());
        }
    }
}

impl HostPath {
    fn new() -> Self {
        HostPath {
            engine: JoinEngine::default(),
            decoder: FrameDecoder::new(),
            reader: BatchReader::new(),
            elems: Aggregator::new(),
            elem_label: PairLabel::default(),
            out: Written {
                joined: Aggregator::new(),
                label: PairLabel::default(),
                file: JsonLines::new(std::io::sink()),
                offered: 0,
                written: 0,
            },
        }
    }

    /// (Not inlined: `callgrind --toggle-collect` counts this function only,
    /// see [`cold_pass_once`].)
    #[inline(never)]
    fn input(&mut self, i: HostInput) {
        match i {
            HostInput::Elem(e) => {
                let label = self.elem_label.get(&e.vm, &e.device);
                self.elems.record_points(label, &e.ts);
                self.engine.push_host_ref(&e, &mut self.out);
            }
            HostInput::Frame(f) => {
                // The network thread's part (the frame's structure), then
                // the main thread's (each record read in place and joined).
                self.decoder.feed(&f);
                while let Some(m) = self.decoder.next_inbound().unwrap() {
                    let Inbound::Batch(batch) = m else {
                        continue;
                    };
                    let (engine, out) = (&mut self.engine, &mut self.out);
                    self.reader.read(&batch, |r| {
                        if let Ok(GuestRecordRef::Rq(rq)) = r {
                            engine.push_guest_ref("vm0", rq, out);
                        }
                    });
                }
            }
            HostInput::Probe(a, b, c, d) => {
                let _ = self.engine.clock("vm0").add_guest_probe(a, b, c, d);
            }
        }
    }

    fn finish(&mut self) -> u64 {
        self.engine.flush(&mut self.out);
        self.out.offered
    }
}

/// The joined host agent's whole per-I/O path (decode the guest's frames →
/// join with the host elements → statistics → always-on output) on a
/// QD32-like stream: CPU per I/O.
fn bench_host_path(c: &mut Criterion) {
    let (inputs, ios) = host_inputs(100_000, 30_000);
    let run = |inputs: Vec<HostInput>| {
        let mut p = HostPath::new();
        for i in inputs {
            p.input(i);
        }
        let n = p.finish();
        let s = p.engine.stats();
        assert_eq!(s.joined, ios as u64, "{s:?}");
        (n, p.out.written)
    };
    let mut cpu = u64::MAX;
    for _ in 0..5 {
        let ev = inputs.clone();
        let c0 = thread_cpu_ns();
        black_box(run(ev));
        cpu = cpu.min(thread_cpu_ns() - c0);
    }
    eprintln!(
        "host_path/qd32: {ios} I/Os in {:.1} ms CPU (best of 5) = {:.0} ns CPU per I/O",
        cpu as f64 / 1e6,
        cpu as f64 / ios as f64
    );
    let mut g = c.benchmark_group("host_path");
    g.measurement_time(Duration::from_secs(5));
    g.sample_size(10);
    g.throughput(Throughput::Elements(ios as u64));
    g.bench_function("qd32_joined", |b| {
        b.iter_batched(
            || inputs.clone(),
            |ev| black_box(run(ev)),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

/// Bytes written to push the host path's state out of the CPU caches (more
/// than this machine's last-level cache).
const EVICT_BYTES: usize = 48 << 20;

/// The same path as it runs live, at ~2 000 IOPS: the agent sleeps between
/// passes while the guest (under TCG, the whole other core) runs, so each pass
/// starts with cold caches. The caches are flushed before every guest frame
/// (one per 100 ms, 200 I/Os); only the path's own CPU time is counted (the
/// inputs' clones included, as in `qd32_joined`).
fn bench_host_path_cold(c: &mut Criterion) {
    let (inputs, ios) = host_inputs(20_000, 500_000);
    let mut evict = vec![0u8; EVICT_BYTES];
    let mut g = c.benchmark_group("host_path");
    g.measurement_time(Duration::from_secs(5));
    g.sample_size(10);
    g.throughput(Throughput::Elements(ios as u64));
    g.bench_function("cold_2k_iops", |b| {
        b.iter_custom(|iters| {
            let cpu = (0..iters)
                .map(|it| cold_pass(inputs.iter().cloned(), ios, &mut evict, it as u8))
                .sum();
            Duration::from_nanos(cpu)
        })
    });
    g.finish();
}

/// One pass of the host path over `inputs` ([`host_inputs`] of `ios` I/Os),
/// the caches flushed by writing `evict` before every guest frame (a
/// different byte each `round`); returns the path's own CPU time (ns).
fn cold_pass(
    inputs: impl IntoIterator<Item = HostInput>,
    ios: usize,
    evict: &mut [u8],
    round: u8,
) -> u64 {
    let mut p = HostPath::new();
    let mut cpu = 0;
    let mut t0 = thread_cpu_ns();
    for i in inputs {
        if matches!(i, HostInput::Frame(_)) {
            cpu += thread_cpu_ns() - t0;
            for line in evict.chunks_mut(64) {
                line[0] = line[0].wrapping_add(round | 1);
            }
            black_box(&*evict);
            t0 = thread_cpu_ns();
        }
        p.input(black_box(i));
    }
    black_box(p.finish());
    cpu += thread_cpu_ns() - t0;
    assert_eq!(p.engine.stats().joined, ios as u64);
    cpu
}

/// One cold pass of [`bench_host_path_cold`], outside criterion, for a
/// deterministic count of instructions and cache misses per I/O:
///
/// ```sh
/// VIOTRACE_COLD_PASS_EVICT=4194304 valgrind --tool=callgrind --cache-sim=yes \
///     --LL=2097152,16,64 --toggle-collect='*HostPath*input*' \
///     target/release/deps/shared-* --cold-pass
/// ```
///
/// The eviction size comes from `VIOTRACE_COLD_PASS_EVICT` (bytes; default
/// [`EVICT_BYTES`]): under a simulator it need only exceed the simulated
/// last-level cache.
fn cold_pass_once() {
    let evict_bytes = std::env::var("VIOTRACE_COLD_PASS_EVICT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(EVICT_BYTES);
    let (inputs, ios) = host_inputs(20_000, 500_000);
    let mut evict = vec![0u8; evict_bytes];
    // (The inputs moved in, not cloned: a clone would bring each into the cache.)
    let cpu = cold_pass(inputs, ios, &mut evict, 0);
    eprintln!(
        "cold pass: {ios} I/Os, {:.0} ns CPU per I/O (evicting {evict_bytes} bytes per frame)",
        cpu as f64 / ios as f64
    );
}

criterion_group!(
    benches,
    bench_join,
    bench_host_path,
    bench_host_path_cold,
    bench_proto,
    bench_clock,
    bench_transport
);
fn main() {
    if std::env::args().any(|a| a == "--cold-pass") {
        cold_pass_once();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
