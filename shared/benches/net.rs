//! The host transport's network thread, live over a Unix socket: CPU time and
//! wakeups of the thread serving one guest that streams QD32-like batches.
//!
//! A fake guest sends one batch frame (560 request records, ~5 600 IOPS) every
//! 100 ms, written in 16 KiB pieces (the guest's largest write, one vsock packet
//! each) a few µs apart,
//! and answers the host's clock pings; the "agent" drains the inbox every
//! 75 ms. Prints the network thread's CPU ns per record and its wakeups per
//! second (from `/proc/self/task/*/schedstat`).
//!
//! `cargo bench -p viotrace-shared --features host --bench net`

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use viotrace_shared::join::synth::{generate, SynthConfig};
use viotrace_shared::proto::{
    encode_frame_into, read_message, write_message, FrameDecoder, GuestRecord, Message,
};
use viotrace_shared::transport::host::{self, EventKind, HostConfig, Listen, NetRuntime};
use viotrace_shared::transport::local_hello;

const RECORDS_PER_BATCH: usize = 560;
const BATCH_EVERY: Duration = Duration::from_millis(100);
/// The guest's largest write.
const PIECE: usize = viotrace_shared::transport::guest::WRITE_CHUNK;
const PIECE_GAP: Duration = Duration::from_micros(20);
const RUN: Duration = Duration::from_secs(4);

/// (CPU ns, context switches) of this process's threads named `name`.
fn thread_stats(name: &str) -> (u64, u64) {
    let mut cpu = 0;
    let mut switches = 0;
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let p = t.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let s = std::fs::read_to_string(p.join("schedstat")).unwrap_or_default();
        let f: Vec<u64> = s
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if f.len() == 3 {
            cpu += f[0];
            switches += f[2];
        }
    }
    (cpu, switches)
}

fn batch_frames(n: usize) -> Vec<Vec<u8>> {
    let s = generate(&SynthConfig {
        requests: RECORDS_PER_BATCH * n,
        ..SynthConfig::default()
    });
    s.guest
        .chunks(RECORDS_PER_BATCH)
        .enumerate()
        .map(|(i, c)| {
            let records = c.iter().cloned().map(GuestRecord::Rq).collect();
            let first_seq = (i * RECORDS_PER_BATCH) as u64;
            let mut f = Vec::new();
            encode_frame_into(&Message::Batch { first_seq, records }, &mut f).unwrap();
            f
        })
        .collect()
}

/// The fake guest: hello, then batches in pieces; answers pings from a reader.
fn guest(path: std::path::PathBuf, frames: Vec<Vec<u8>>) {
    let mut s = UnixStream::connect(&path).unwrap();
    write_message(&mut s, &Message::Hello(local_hello("bench", None))).unwrap();
    let _ack = read_message(&mut s).unwrap();
    let mut r = s.try_clone().unwrap();
    let mut w = s.try_clone().unwrap();
    let pongs = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Vec<u8>>::new()));
    let pongs2 = pongs.clone();
    std::thread::spawn(move || {
        let mut d = FrameDecoder::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match r.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            d.feed(&buf[..n]);
            while let Ok(Some(m)) = d.next_message() {
                if let Message::ClockPing { seq, h1 } = m {
                    let mut f = Vec::new();
                    let (g2, g3) = (h1, h1);
                    encode_frame_into(&Message::ClockPong { seq, h1, g2, g3 }, &mut f).unwrap();
                    pongs2.lock().unwrap().push(f);
                }
            }
        }
    });
    let start = Instant::now();
    for (i, f) in frames.iter().enumerate() {
        let at = start + BATCH_EVERY * i as u32;
        if let Some(d) = at.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        for p in std::mem::take(&mut *pongs.lock().unwrap()) {
            w.write_all(&p).unwrap();
        }
        for piece in f.chunks(PIECE) {
            w.write_all(piece).unwrap();
            let t = Instant::now();
            while t.elapsed() < PIECE_GAP {
                std::hint::spin_loop();
            }
        }
    }
    write_message(
        &mut w,
        &Message::Bye {
            reason: "done".into(),
        },
    )
    .unwrap();
}

fn main() {
    let batches = (RUN.as_millis() / BATCH_EVERY.as_millis()) as usize;
    let frames = batch_frames(batches);
    let bytes: usize = frames.iter().map(Vec::len).sum();
    let path = std::env::temp_dir().join(format!("viotrace-net-{}.sock", std::process::id()));
    let cfg = HostConfig {
        listens: vec![Listen::Unix {
            path: path.clone(),
            vm: "vm".into(),
        }],
        ..HostConfig::default()
    };
    let net = NetRuntime::start("viotrace-net").unwrap();
    let (server, mut inbox) = net.block_on(host::serve(cfg)).unwrap();
    let g = std::thread::spawn(move || guest(path, frames));
    let (cpu0, sw0) = thread_stats("viotrace-net");
    let t0 = Instant::now();
    let mut records = 0;
    let mut done = false;
    while !done {
        std::thread::sleep(Duration::from_millis(75));
        inbox.drain(Duration::from_millis(20), |e| match e.kind {
            EventKind::Records { batch, .. } => records += batch.len(),
            EventKind::Disconnected { .. } => done = true,
            _ => {}
        });
        assert!(t0.elapsed() < RUN * 3, "the guest did not finish");
    }
    let secs = t0.elapsed().as_secs_f64();
    let (cpu1, sw1) = thread_stats("viotrace-net");
    g.join().unwrap();
    assert_eq!(records, batches * RECORDS_PER_BATCH);
    let cpu = (cpu1 - cpu0) as f64;
    eprintln!(
        "net/unix: {records} records ({} KiB) in {secs:.1} s: {:.0} ns CPU per record, {:.1} wakeups/s, {:.1} µs CPU per wakeup",
        bytes / 1024,
        cpu / records as f64,
        (sw1 - sw0) as f64 / secs,
        cpu / 1e3 / (sw1 - sw0).max(1) as f64,
    );
    net.block_on(server.shutdown(Duration::from_millis(500)));
}
