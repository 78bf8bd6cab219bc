//! Re-encodes a capture file's records, to profile the capture's encoding on
//! real records (e.g. under `valgrind --tool=callgrind`):
//!
//! `capture_encode FILE [ROUNDS]` reads FILE's records, then pushes every one
//! into a capture written to nowhere ROUNDS times (default 10), and prints the
//! records pushed and the bytes written.

use std::io::{self, Write};

use viotrace_shared::capture::{CaptureReader, CaptureWriter, Item};

/// A sink that counts the bytes written to it.
struct Count(u64);

impl Write for Count {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0 += b.len() as u64;
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: capture_encode FILE [ROUNDS]")?;
    let rounds: u32 = args.next().map(|r| r.parse()).transpose()?.unwrap_or(10);
    let reader = CaptureReader::new(io::BufReader::new(std::fs::File::open(&path)?))?;
    let hello = reader.hello.clone();
    let mut records = Vec::new();
    for item in reader {
        match item {
            Ok(Item::Record(r)) => records.push(r),
            Ok(Item::End(_)) => {}
            // (a capture that did not finish: its records are enough)
            Err(e) => eprintln!("{path}: {e}"),
        }
    }
    let mut w = CaptureWriter::new(Count(0), &hello)?;
    for _ in 0..rounds {
        for r in &records {
            w.push(r.borrowed());
        }
    }
    w.flush();
    let lost = w.lost;
    let out = w.finish(b"{}")?;
    println!(
        "{} records pushed, {lost} lost, {} bytes",
        records.len() as u64 * u64::from(rounds),
        out.0
    );
    Ok(())
}
