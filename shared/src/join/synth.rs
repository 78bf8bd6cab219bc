//! Synthetic guest/host streams with a known truth, for tests and benchmarks
//! (behind the `testing` feature).

use crate::record::{Backend, GuestRq, HostElem, Op, Point, Points};

/// SplitMix64.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

#[derive(Clone, Debug)]
pub struct SynthConfig {
    pub vm: String,
    pub requests: usize,
    pub queues: u16,
    /// Mean guest time between request starts.
    pub interval_ns: u64,
    /// Backend service time range.
    pub service_ns: (u64, u64),
    /// Requests per guest batch (one kick per batch), 1 = no batching.
    pub batch: usize,
    /// Whether each batch is one merged backend request (shared `merge_id`).
    pub merge: bool,
    /// Sectors are drawn from this many distinct 4 KiB blocks (small = many repeats).
    pub blocks: u64,
    /// `host − guest` at guest time 0 and the drift.
    pub theta_ns: i64,
    pub drift_ppm: f64,
    /// Guest-initiated probe every this many guest ns (0: none).
    pub probe_every_ns: u64,
    pub seed: u64,
    /// Guest time of the first request.
    pub start_ns: u64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            vm: "vm0".into(),
            requests: 1000,
            queues: 2,
            interval_ns: 100_000,
            service_ns: (50_000, 400_000),
            batch: 1,
            merge: false,
            blocks: 65_536,
            theta_ns: 5_000_000_000,
            drift_ppm: 40.0,
            probe_every_ns: 50_000_000,
            seed: 1,
            start_ns: 1_000_000_000,
        }
    }
}

/// A generated stream. `guest[i]` and `host[i]` are the same request (the
/// truth); `guest[i].pid == i`.
#[derive(Clone, Debug)]
pub struct SynthStream {
    pub guest: Vec<GuestRq>,
    pub host: Vec<HostElem>,
    /// Guest-initiated probes `(t1, t2, t3, t4)`.
    pub probes: Vec<(u64, u64, u64, u64)>,
    pub theta_ns: i64,
    pub drift: f64,
}

impl SynthStream {
    /// The true `host − guest` at guest time `g`.
    pub fn theta(&self, g: u64) -> f64 {
        self.theta_ns as f64 + self.drift * g as f64
    }
    pub fn host_of(&self, g: u64) -> u64 {
        (g as f64 + self.theta(g)).round() as u64
    }
    pub fn guest_of(&self, h: u64) -> u64 {
        ((h as f64 - self.theta_ns as f64) / (1.0 + self.drift)).round() as u64
    }
}

/// One input event for the join.
#[derive(Clone, Debug)]
pub enum Event {
    Guest(GuestRq),
    Host(HostElem),
    Probe(u64, u64, u64, u64),
}

/// What identifies one generated request on both sides.
struct Ids<'a> {
    vm: &'a str,
    queue: u16,
    head: u16,
    op: Op,
    sector: u64,
    /// The request's index (its guest `pid`).
    index: u32,
    kicked: bool,
    merge_id: u64,
}

/// The guest and host records of one generated request.
fn pair(ids: &Ids, g_ts: Points, h_ts: Points) -> (GuestRq, HostElem) {
    let g = GuestRq {
        time: None,
        disk: "vda".into(),
        op: ids.op,
        sector: ids.sector,
        bytes: 4096,
        queue: Some(ids.queue),
        head: Some(ids.head),
        pid: ids.index,
        tid: ids.index,
        comm: "fio".into(),
        cgroup_id: 1,
        inode: 12,
        file_offset: Some(ids.sector * 512),
        kicked: Some(ids.kicked),
        bios: 1,
        error: 0,
        ts: g_ts,
    };
    let h = HostElem {
        time: None,
        vm: ids.vm.into(),
        qemu_pid: 100,
        device: "virtio-disk0".into(),
        queue: ids.queue,
        head: ids.head,
        op: ids.op,
        sector: ids.sector,
        bytes: 4096,
        backend: Backend::Threads,
        merge_id: ids.merge_id,
        status: Some(0),
        ts: h_ts,
        interference: None,
    };
    (g, h)
}

/// Generates a stream with a known truth (see [`SynthConfig`]).
pub fn generate(cfg: &SynthConfig) -> SynthStream {
    let mut r = Rng(cfg.seed);
    let drift = cfg.drift_ppm * 1e-6;
    let mut s = SynthStream {
        guest: Vec::with_capacity(cfg.requests),
        host: Vec::with_capacity(cfg.requests),
        probes: Vec::new(),
        theta_ns: cfg.theta_ns,
        drift,
    };
    let queues = cfg.queues.max(1) as usize;
    // Per queue: busy-until (guest time) of each head.
    let mut heads: Vec<Vec<u64>> = vec![Vec::new(); queues];
    let start = cfg.start_ns.max(cfg.probe_every_ns);
    let mut t: u64 = start;
    let mut i = 0usize;
    let mut merge_id = 1u64;
    while i < cfg.requests {
        let n = cfg.batch.max(1).min(cfg.requests - i);
        let q = r.below(queues as u64) as usize;
        let kick = t + 4_000 + 1_000 * n as u64 + 1_000;
        let pop0 = s.host_of(kick) + 15_000 + r.below(20_000);
        let service = cfg.service_ns.0 + r.below(cfg.service_ns.1 - cfg.service_ns.0 + 1);
        let base_block = r.below(cfg.blocks.max(1));
        let mut group_submit = 0;
        for j in 0..n {
            let pop = pop0 + 2_000 * j as u64;
            let submit = if cfg.merge {
                if j == 0 {
                    group_submit = pop0 + 2_000 * n as u64 + 3_000;
                }
                group_submit
            } else {
                pop + 3_000
            };
            let own_service = if cfg.merge {
                service
            } else {
                service + r.below(50_000)
            };
            let io_issue = submit + 2_000;
            let io_complete = io_issue + own_service;
            let complete_cb = io_complete + 3_000;
            let push = complete_cb + 2_000 + 1_000 * j as u64;
            let hirq = push + 1_000;
            let girq = s.guest_of(hirq + 8_000 + r.below(10_000));
            let done = girq + 4_000;
            let head = take_head(&mut heads[q], t, done);
            let block = if cfg.merge {
                (base_block + j as u64) % cfg.blocks.max(1)
            } else {
                r.below(cfg.blocks.max(1))
            };
            let op = if r.below(3) == 0 { Op::Write } else { Op::Read };
            let sector = block * 8;
            let g_ts: Points = [
                (Point::BioQueue, t),
                (Point::RqIssue, t + 2_000),
                (Point::VqAdd, t + 4_000 + 1_000 * j as u64),
                (Point::Kick, kick),
                (Point::Irq, girq),
                (Point::DriverComplete, girq + 2_000),
                (Point::RqComplete, done),
            ]
            .into_iter()
            .collect();
            let h_ts: Points = [
                (Point::HostPop, pop),
                (Point::HostSubmit, submit),
                (Point::HostIoIssue, io_issue),
                (Point::HostIoComplete, io_complete),
                (Point::HostCompleteCb, complete_cb),
                (Point::HostPush, push),
                (Point::HostIrq, hirq),
            ]
            .into_iter()
            .collect();
            let (g, h) = pair(
                &Ids {
                    vm: &cfg.vm,
                    queue: q as u16,
                    head: head as u16,
                    op,
                    sector,
                    index: (i + j) as u32,
                    kicked: j + 1 == n,
                    merge_id: if cfg.merge {
                        merge_id
                    } else {
                        merge_id + j as u64
                    },
                },
                g_ts,
                h_ts,
            );
            s.guest.push(g);
            s.host.push(h);
        }
        merge_id += n as u64;
        i += n;
        t += cfg.interval_ns / 2 + r.below(cfg.interval_ns.max(1)) * n as u64;
    }
    if cfg.probe_every_ns > 0 {
        add_probes(
            &mut s,
            &mut r,
            start - cfg.probe_every_ns,
            t + 1_000_000_000,
            cfg.probe_every_ns,
        );
    }
    s
}

/// The lowest head of a queue free at `t` (`busy`: each head's busy-until),
/// taken until `done`.
fn take_head(busy: &mut Vec<u64>, t: u64, done: u64) -> usize {
    let head = match busy.iter().position(|&b| b < t) {
        Some(h) => h,
        None => {
            busy.push(0);
            busy.len() - 1
        }
    };
    busy[head] = done + 1;
    head
}

/// Guest-initiated probes every `every` guest ns over `[from, end)`.
fn add_probes(s: &mut SynthStream, r: &mut Rng, from: u64, end: u64, every: u64) {
    let mut g = from;
    while g < end {
        let t2 = s.host_of(g) + 30_000 + r.below(200_000);
        let t3 = t2 + 2_000;
        let t4 = s.guest_of(t3 + 40_000 + r.below(300_000));
        s.probes.push((g, t2, t3, t4));
        g += every;
    }
}

/// Interleaves the stream as a host would receive it: records in completion
/// order, guest records (and probes) `guest_lag_ns` late, plus `shuffle`
/// random swaps of nearby events of different sources (host ring buffer vs the
/// guest's connection, which keeps its own order).
pub fn interleave(s: &SynthStream, guest_lag_ns: u64, shuffle: usize, seed: u64) -> Vec<Event> {
    let mut ev: Vec<(u64, Event)> = Vec::with_capacity(s.guest.len() * 2 + s.probes.len());
    for g in &s.guest {
        let done = g.ts.get(Point::RqComplete).unwrap_or(0);
        ev.push((s.host_of(done) + guest_lag_ns, Event::Guest(g.clone())));
    }
    for h in &s.host {
        let at = h.ts.iter().map(|e| e.1).max().unwrap_or(0);
        ev.push((at, Event::Host(h.clone())));
    }
    for &(t1, t2, t3, t4) in &s.probes {
        ev.push((s.host_of(t4) + guest_lag_ns, Event::Probe(t1, t2, t3, t4)));
    }
    ev.sort_by_key(|e| e.0);
    let mut r = Rng(seed);
    let n = ev.len();
    for _ in 0..shuffle {
        if n < 2 {
            break;
        }
        let a = r.below(n as u64) as usize;
        let b = (a + 1 + r.below(16) as usize).min(n - 1);
        // The guest's records and probes come over one ordered connection: only
        // the two sources' relative order varies (a host record swaps with a
        // guest event), never the guest stream's own order.
        let host = |e: &Event| matches!(e, Event::Host(_));
        if host(&ev[a].1) != host(&ev[b].1) {
            ev.swap(a, b);
        }
    }
    ev.into_iter().map(|e| e.1).collect()
}
