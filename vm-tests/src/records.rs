//! An agent's JSON-lines output read as typed [`Record`]s (the VM tests' view).

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use viotrace_shared::capture::{render_json, CaptureReader};
use viotrace_shared::record::{GuestIo, GuestRq, HostElem, JoinedIo, Record, Stats};

/// The guest agent's capture of run directory `out` (`guest.cap`), opened, its path.
fn open_capture(out: &Path) -> Result<(CaptureReader<BufReader<File>>, PathBuf)> {
    let src = out.join("guest.cap");
    let f = File::open(&src).with_context(|| format!("open {}", src.display()))?;
    let rd = CaptureReader::new(BufReader::new(f)).with_context(|| format!("{}", src.display()))?;
    Ok((rd, src))
}

/// Decodes the guest agent's capture (`guest.cap`) into `guest.cap.jsonl`, the JSON
/// lines `--json` prints. A capture that is missing, damaged or unfinished fails the run.
pub fn decode_capture(out: &Path) -> Result<u64> {
    let (mut rd, src) = open_capture(out)?;
    let dst = out.join("guest.cap.jsonl");
    let mut w = std::io::BufWriter::new(File::create(&dst)?);
    let n = render_json(&mut rd, &mut w).with_context(|| {
        format!(
            "{}: the guest's capture, after {} records",
            src.display(),
            rd.records()
        )
    })?;
    std::io::Write::flush(&mut w)?;
    Ok(n)
}

/// Reads the guest agent's capture (`guest.cap`) through to its end chunk: the
/// records it holds. A capture that is missing, damaged or unfinished is an error
/// naming where it stops (the reader fails a file without its end chunk).
pub fn count_capture(out: &Path) -> Result<u64> {
    let (mut rd, src) = open_capture(out)?;
    for item in rd.by_ref() {
        item.with_context(|| format!("{}", src.display()))?;
    }
    Ok(rd.records())
}

/// The records of one output file, in order.
#[derive(Clone, Debug, Default)]
pub struct Records(pub Vec<Record>);

impl Records {
    /// Reads `p`; a line that is not a record of a known kind is an error.
    pub fn read(p: &Path) -> Result<Records> {
        crate::result::read_lines_as(p).map(Records)
    }

    pub fn guest_rqs(&self) -> Vec<&GuestRq> {
        self.0
            .iter()
            .filter_map(|r| match r {
                Record::GuestRq(x) => Some(x),
                _ => None,
            })
            .collect()
    }

    pub fn guest_ios(&self) -> Vec<&GuestIo> {
        self.0
            .iter()
            .filter_map(|r| match r {
                Record::GuestIo(x) => Some(x),
                _ => None,
            })
            .collect()
    }

    pub fn host_elems(&self) -> Vec<&HostElem> {
        self.0
            .iter()
            .filter_map(|r| match r {
                Record::HostElem(x) => Some(x),
                _ => None,
            })
            .collect()
    }

    /// End-to-end records (`"kind":"io"`).
    pub fn ios(&self) -> Vec<&JoinedIo> {
        self.0
            .iter()
            .filter_map(|r| match r {
                Record::Io(x) => Some(x),
                _ => None,
            })
            .collect()
    }

    /// The last stats line.
    pub fn stats(&self) -> Option<&Stats> {
        self.0.iter().rev().find_map(|r| match r {
            Record::Stats(x) => Some(x),
            _ => None,
        })
    }
}
