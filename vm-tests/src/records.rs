//! An agent's JSON-lines output read as typed [`Record`]s (the VM tests' view).

use std::path::Path;

use anyhow::Result;
use viotrace_shared::record::{GuestIo, GuestRq, HostElem, JoinedIo, Record, Stats};

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
