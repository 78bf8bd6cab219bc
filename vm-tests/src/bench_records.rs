//! The bench's record files: a capture is checked against the guest agent's own count
//! of the records it wrote, and each round's bulky record files are removed once read
//! (`--keep-records` keeps them). A capture round left 37 MB of capture and 233 MB of
//! its JSON, a `json` round 217 MB: several GB per bench that nothing reads again.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;
use std::path::Path;

use anyhow::Result;

/// The files that hold records (the rest of a round directory is small).
const RECORD_FILES: &[&str] = &[
    "guest.jsonl",
    "guest.cap",
    "guest.cap.jsonl",
    "host.jsonl",
    "joined.jsonl",
];

/// Record files up to this size stay (an always-on run's: its tables, counters and
/// the few slow records).
const KEEP_UP_TO: u64 = 1 << 20;

/// The records the guest agent counted as written to its capture (`capture_records`)
/// that the file does not hold: a loss, 0 when it holds every one. An error when the
/// file cannot be read to its end, or holds records the agent did not count.
pub fn capture_shortfall(dir: &Path, guest: &BTreeMap<String, u64>) -> Result<u64, String> {
    let Some(&written) = guest.get("capture_records") else {
        return Err("the guest agent's counters have no capture_records".into());
    };
    let held = crate::records::count_capture(dir).map_err(|e| format!("{e:#}"))?;
    if held > written {
        return Err(format!(
            "guest.cap holds {held} records, the agent counted {written} written"
        ));
    }
    Ok(written - held)
}

/// Removes the record files of round directory `dir` larger than [`KEEP_UP_TO`],
/// after their round was read, and lists them (name, bytes) in `records-removed.txt`.
/// Returns the bytes removed.
pub fn trim(dir: &Path) -> Result<u64> {
    let mut removed = Vec::new();
    for name in RECORD_FILES {
        let p = dir.join(name);
        let Ok(m) = fs::metadata(&p) else { continue };
        if m.len() > KEEP_UP_TO {
            fs::remove_file(&p)?;
            removed.push((*name, m.len()));
        }
    }
    if !removed.is_empty() {
        let mut f = fs::File::create(dir.join("records-removed.txt"))?;
        writeln!(
            f,
            "record files removed after this round was read (viotrace-vm bench --keep-records keeps them):"
        )?;
        for (name, bytes) in &removed {
            writeln!(f, "{name} {bytes}")?;
        }
    }
    Ok(removed.iter().map(|(_, b)| b).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(written: u64) -> BTreeMap<String, u64> {
        BTreeMap::from([("capture_records".to_string(), written)])
    }

    #[test]
    fn trim_removes_only_large_record_files_and_lists_them() {
        let d = tempfile::tempdir().unwrap();
        fs::write(
            d.path().join("guest.jsonl"),
            vec![b'x'; (KEEP_UP_TO + 1) as usize],
        )
        .unwrap();
        fs::write(d.path().join("host.jsonl"), b"small").unwrap();
        fs::write(
            d.path().join("fio-x.json"),
            vec![b'y'; (KEEP_UP_TO + 5) as usize],
        )
        .unwrap();
        assert_eq!(trim(d.path()).unwrap(), KEEP_UP_TO + 1);
        assert!(!d.path().join("guest.jsonl").exists());
        assert!(d.path().join("host.jsonl").exists());
        assert!(d.path().join("fio-x.json").exists(), "not a record file");
        let list = fs::read_to_string(d.path().join("records-removed.txt")).unwrap();
        assert!(
            list.ends_with(&format!("guest.jsonl {}\n", KEEP_UP_TO + 1)),
            "{list}"
        );
        // Nothing left to remove: no list.
        let e = tempfile::tempdir().unwrap();
        assert_eq!(trim(e.path()).unwrap(), 0);
        assert!(!e.path().join("records-removed.txt").exists());
    }

    #[test]
    fn a_capture_is_checked_against_the_agents_count() {
        use viotrace_shared::capture::CaptureWriter;
        use viotrace_shared::proto::{GuestRecordRef, Hello, PROTOCOL_VERSION};
        let d = tempfile::tempdir().unwrap();
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            agent_version: "0".into(),
            kernel_release: "6.1".into(),
            boot_id: "b".into(),
            hostname: "g".into(),
            cid: Some(3),
            session: 1,
        };
        let n = 5u64;
        let mut w = CaptureWriter::new(Vec::new(), &hello).unwrap();
        for i in 0..n {
            w.push(GuestRecordRef::Rq(&viotrace_shared::proto::sample_rq(i)));
        }
        w.flush();
        let full = w.finish(b"{\"kind\":\"stats\"}\n").unwrap();
        fs::write(d.path().join("guest.cap"), &full).unwrap();
        assert_eq!(capture_shortfall(d.path(), &counters(n)), Ok(0));
        // The agent counted two more written than the file holds: two lost.
        assert_eq!(capture_shortfall(d.path(), &counters(n + 2)), Ok(2));
        // More in the file than counted, no counter, a cut file: errors.
        assert!(capture_shortfall(d.path(), &counters(n - 1)).is_err());
        assert!(capture_shortfall(d.path(), &BTreeMap::new()).is_err());
        fs::write(d.path().join("guest.cap"), &full[..full.len() - 3]).unwrap();
        let e = capture_shortfall(d.path(), &counters(n)).unwrap_err();
        assert!(e.contains("guest.cap"), "{e}");
    }
}
