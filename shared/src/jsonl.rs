//! The one JSON-lines writer of the agents and the lab: every line is one
//! record `{"kind":K, …fields}`, `K` fixed by the record's type ([`Kind`]), the
//! same tags [`Record`] reads back.

use std::io::{self, Write};

use serde::Serialize;

use crate::record::{GuestIo, GuestRq, HostElem, JoinedIo, Record, Stats};

/// A record type and its `"kind"` tag.
pub trait Kind: Serialize {
    const KIND: &'static str;
}

impl Kind for GuestRq {
    const KIND: &'static str = "guest_rq";
}
impl Kind for GuestIo {
    const KIND: &'static str = "guest_io";
}
impl Kind for HostElem {
    const KIND: &'static str = "host_elem";
}
impl Kind for JoinedIo {
    const KIND: &'static str = "io";
}
impl Kind for Stats {
    const KIND: &'static str = "stats";
}

/// Writes records as JSON lines into `W`, through a reused buffer (no
/// allocation per record once warm). Write errors are returned and counted.
pub struct JsonLines<W: Write> {
    out: W,
    buf: Vec<u8>,
    /// Records that could not be written.
    pub errors: u64,
}

impl<W: Write> JsonLines<W> {
    pub fn new(out: W) -> Self {
        JsonLines {
            out,
            buf: Vec::with_capacity(1024),
            errors: 0,
        }
    }

    /// Writes one record: `{"kind":K,` then the record's own fields.
    pub fn write<T: Kind>(&mut self, v: &T) -> io::Result<()> {
        let r = self.write_inner(T::KIND, v);
        if r.is_err() {
            self.errors += 1;
        }
        r
    }

    fn write_inner<T: Serialize>(&mut self, kind: &str, v: &T) -> io::Result<()> {
        self.buf.clear();
        write!(self.buf, "{{\"kind\":\"{kind}\"")?;
        let start = self.buf.len();
        serde_json::to_writer(&mut self.buf, v)?;
        // The record's own object without its opening brace follows the tag.
        match &self.buf[start..] {
            b"{}" => self.buf.truncate(start),
            _ => self.buf[start] = b',',
        }
        if !self.buf.ends_with(b"}") {
            self.buf.push(b'}');
        }
        self.buf.push(b'\n');
        self.out.write_all(&self.buf)
    }

    /// Writes any [`Record`].
    pub fn record(&mut self, r: &Record) -> io::Result<()> {
        match r {
            Record::GuestRq(v) => self.write(v),
            Record::GuestIo(v) => self.write(v),
            Record::HostElem(v) => self.write(v),
            Record::Io(v) => self.write(v),
            Record::Stats(v) => self.write(v),
        }
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<T: Kind>(v: &T) -> String {
        let mut w = JsonLines::new(Vec::new());
        w.write(v).unwrap();
        String::from_utf8(w.out).unwrap()
    }

    #[test]
    fn every_kind_reads_back_as_its_record() {
        let rq: GuestRq = serde_json::from_str(
            r#"{"disk":"vda","op":"read","sector":8,"bytes":512,"pid":1,"tid":1,"comm":"x",
            "cgroup_id":0,"inode":0,"bios":1,"error":0,"ts":{"g.rq_issue":5}}"#,
        )
        .unwrap();
        let l = line(&rq);
        assert!(
            l.starts_with(r#"{"kind":"guest_rq","#) && l.ends_with("}\n"),
            "{l}"
        );
        assert_eq!(
            serde_json::from_str::<Record>(&l).unwrap(),
            Record::GuestRq(rq)
        );
        let mut st = Stats {
            mode: Some("fentry".into()),
            blind_points: Some(vec![]),
            ..Stats::default()
        };
        st.values.insert("records".into(), 3);
        let l = line(&st);
        assert!(
            l.contains(r#""records":3"#) && l.contains(r#""blind_points":[]"#),
            "{l}"
        );
        assert_eq!(
            serde_json::from_str::<Record>(&l).unwrap(),
            Record::Stats(st)
        );
        // Every record kind's tag is the one Record reads.
        for (kind, json) in [
            (GuestIo::KIND, "guest_io"),
            (HostElem::KIND, "host_elem"),
            (JoinedIo::KIND, "io"),
            (Stats::KIND, "stats"),
        ] {
            assert_eq!(kind, json);
        }
    }

    #[test]
    fn write_errors_are_counted() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Err(io::Error::other("disk full"))
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut w = JsonLines::new(Full);
        assert!(w.write(&Stats::default()).is_err());
        assert_eq!(w.errors, 1);
    }
}
