//! The capture file: every record an agent produced, in the wire protocol's
//! record encoding, written as it comes and rendered to JSON lines later
//! (`viotrace-guest decode FILE`), on whatever machine reads it. The traced
//! machine pays for a record's compact encoding and a copy, not for JSON
//! (`perf record` / `perf script`).
//!
//! Layout: [`MAGIC`], then chunks `[kind: u8][len: u32 LE][payload: len bytes]`:
//! - [`HELLO`] (first, once): the writer's [`Hello`] (postcard), as the uplink
//!   sends it; its `protocol_version` is the records' encoding;
//! - [`RECORDS`]: a varint count, then that many records as a batch holds
//!   them: [`encode_record_into`](crate::proto::encode_record_into)'s, or a
//!   request record in the guest BPF layout
//!   ([`rq_bpf::encode_record`](crate::proto::rq_bpf::encode_record), since
//!   protocol 8: the guest agent's captures), or a syscall record in the
//!   guest BPF layout ([`io_bpf::encode_record`](crate::proto::io_bpf::encode_record),
//!   since format 2: a guest agent's record without off-CPU time or cause;
//!   it holds the requests beyond those listed, read since format 3);
//! - [`END`] (last, once): the writer's final `"kind":"stats"` JSON line.
//!
//! A file without its `END` chunk is a capture that did not finish (the agent
//! was killed, the disk filled): its records read, and the reader says so.

use std::io::{self, Read, Write};

use thiserror::Error;

use crate::proto::{
    encode_record_append, GuestRecord, GuestRecordRef, Hello, ProtoError, PROTOCOL_VERSION,
};
use crate::varint;

/// The first bytes of a capture file; the last is the format's version
/// ([`FORMAT`]).
pub const MAGIC: &[u8; 8] = b"VIOTCAP\x03";
/// The capture format this writer writes and the newest its reader reads (2:
/// records may be syscall records in the guest BPF layout, record tag 3; 3: a
/// syscall record's postcard form is tag 4, with `requests_unlisted`, where
/// formats 1 and 2 wrote tag 1 without it).
pub const FORMAT: u8 = 3;
/// The oldest capture format the reader reads (1: tags 0 to 2).
pub const OLDEST_FORMAT: u8 = 1;
/// The oldest protocol version whose captures this reader decodes (7's
/// records are a subset of 8's: 8 added request records in the BPF layout).
pub const OLDEST_VERSION: u16 = 7;
/// Chunk kinds.
pub const HELLO: u8 = 1;
pub const RECORDS: u8 = 2;
pub const END: u8 = 3;
/// A records chunk is written once its encoded records reach this size.
pub const CHUNK_BYTES: usize = 64 * 1024;
/// The largest chunk payload a reader accepts (a writer's chunk is at most
/// [`CHUNK_BYTES`] plus one record).
pub const MAX_CHUNK: usize = 4 << 20;
const CHUNK_HEADER: usize = 5;

#[derive(Debug, Error)]
pub enum CaptureError {
    #[error("not a viotrace capture file (bad magic {0:02x?})")]
    BadMagic(Vec<u8>),
    #[error(
        "capture format {got}; this reader reads formats {OLDEST_FORMAT} to {FORMAT} \
         (a newer viotrace wrote it)"
    )]
    Format { got: u8 },
    #[error(
        "capture written with protocol version {got}; this reader decodes versions {} to {want}",
        OLDEST_VERSION
    )]
    Version { got: u16, want: u16 },
    #[error("chunk at byte {at}: unknown kind {kind}")]
    UnknownChunk { at: u64, kind: u8 },
    #[error("chunk at byte {at}: {len} bytes announced, more than {MAX_CHUNK}")]
    Oversized { at: u64, len: usize },
    #[error("chunk at byte {at}: the file ends inside it ({have} of {need} bytes)")]
    Truncated { at: u64, have: usize, need: usize },
    #[error("chunk at byte {at}: {what}")]
    Malformed { at: u64, what: String },
    #[error("the capture has no hello chunk first")]
    NoHello,
    #[error(
        "the capture ends without its final statistics: the agent did not finish \
         (killed, or its disk filled) after {records} records"
    )]
    NoEnd { records: u64 },
    #[error("{0} bytes after the end chunk")]
    AfterEnd(u64),
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Proto(#[from] ProtoError),
}

/// One chunk whose payload is `parts` concatenated.
fn write_chunk<W: Write>(out: &mut W, kind: u8, parts: &[&[u8]]) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut h = [0u8; CHUNK_HEADER];
    h[0] = kind;
    h[1..].copy_from_slice(&(len as u32).to_le_bytes());
    out.write_all(&h)?;
    parts.iter().try_for_each(|p| out.write_all(p))
}

/// Writes a capture file. Records are encoded into an open chunk and the
/// chunk written when it is full ([`CHUNK_BYTES`]) or flushed. After a write
/// error the writer stops (the file's framing may be cut): the records of the
/// failed chunk and every later one are counted in `lost`, never silently
/// gone; `written + lost` is every record pushed.
pub struct CaptureWriter<W: Write> {
    out: W,
    /// The open chunk's encoded records.
    pending: Vec<u8>,
    pending_count: u64,
    /// Records in chunks written.
    pub written: u64,
    /// Records that could not be encoded or written.
    pub lost: u64,
    /// The first write or encoding error, once.
    pub failed: Option<String>,
}

impl<W: Write> CaptureWriter<W> {
    /// Starts a capture on `out`: the magic and the hello chunk.
    pub fn new(mut out: W, hello: &Hello) -> Result<Self, CaptureError> {
        let h = postcard::to_allocvec(hello).map_err(ProtoError::Encode)?;
        out.write_all(MAGIC)?;
        write_chunk(&mut out, HELLO, &[&h])?;
        Ok(CaptureWriter {
            out,
            pending: Vec::with_capacity(CHUNK_BYTES + 1024),
            pending_count: 0,
            written: 0,
            lost: 0,
            failed: None,
        })
    }

    /// Adds one record.
    pub fn push(&mut self, rec: GuestRecordRef<'_>) {
        self.append(|buf| encode_record_append(&rec, buf).map_err(|e| Some(e.to_string())));
    }

    /// Adds a request record in the guest BPF object's layout, as the ring
    /// buffer held it ([`crate::proto::rq_bpf`]): copied, not encoded.
    pub fn push_rq_bpf(&mut self, bpf: &[u8], wall_offset: i64, disk: &str) {
        // (one that is not such a record is lost alone, counted: the ring
        // buffer's request records always are)
        self.append(|buf| {
            crate::proto::rq_bpf::encode_record(bpf, wall_offset, disk, buf).ok_or(None)
        });
    }

    /// Adds a syscall record in the guest BPF object's layout, as the ring
    /// buffer held it ([`crate::proto::io_bpf`]), with its references' disk
    /// names: copied, not encoded. (The record must have no off-CPU time and
    /// no cause: those are the agent's, not in the layout.)
    pub fn push_io_bpf<'a>(
        &mut self,
        bpf: &[u8],
        wall_offset: i64,
        disks: impl ExactSizeIterator<Item = &'a str> + Clone,
    ) {
        self.append(|buf| {
            crate::proto::io_bpf::encode_record(bpf, wall_offset, disks, buf).ok_or(None)
        });
    }

    /// Adds the record `encode` appends where it goes, the open chunk (which
    /// it leaves untouched on an error), or counts it lost: `Err(Some(why))`
    /// also fails the capture, `Err(None)` loses this record alone.
    fn append(&mut self, encode: impl FnOnce(&mut Vec<u8>) -> Result<(), Option<String>>) {
        if self.failed.is_some() {
            self.lost += 1;
            return;
        }
        if let Err(why) = encode(&mut self.pending) {
            self.lost += 1;
            if let Some(why) = why {
                self.failed.get_or_insert(why);
            }
            return;
        }
        self.pending_count += 1;
        if self.pending.len() >= CHUNK_BYTES {
            self.write_pending();
        }
    }

    fn write_pending(&mut self) {
        if self.pending_count == 0 {
            return;
        }
        let n = std::mem::take(&mut self.pending_count);
        let mut count = Vec::with_capacity(varint::MAX_LEN);
        varint::push(&mut count, n);
        let r = write_chunk(&mut self.out, RECORDS, &[&count, &self.pending]);
        self.pending.clear();
        match r {
            Ok(()) => self.written += n,
            Err(e) => {
                self.lost += n;
                self.failed = Some(format!("writing the capture: {e}"));
            }
        }
    }

    /// Writes the open chunk and flushes the file.
    pub fn flush(&mut self) {
        self.write_pending();
        if self.failed.is_none() {
            if let Err(e) = self.out.flush() {
                self.failed = Some(format!("flushing the capture: {e}"));
            }
        }
    }

    /// The file (or whatever the capture goes to).
    pub fn get_ref(&self) -> &W {
        &self.out
    }

    /// Ends the capture with the final stats line (call [`flush`](Self::flush)
    /// first, so that the line's counters are final).
    pub fn finish(mut self, stats_line: &[u8]) -> Result<W, CaptureError> {
        self.flush();
        if let Some(f) = &self.failed {
            return Err(CaptureError::Io(io::Error::other(f.clone())));
        }
        write_chunk(&mut self.out, END, &[stats_line])?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// What a capture holds, in order. (Records are nearly every item: boxing
/// them to shrink the rare `End` would cost an allocation per record.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug, PartialEq)]
pub enum Item {
    Record(GuestRecord),
    /// The writer's final `"kind":"stats"` line (the last item).
    End(String),
}

/// Reads a capture file: [`hello`](Self::hello), then [`Item`]s. Strict: any
/// damage is an error naming its byte offset, and a file that stops before its
/// end chunk ends with [`CaptureError::NoEnd`].
pub struct CaptureReader<R: Read> {
    r: R,
    pub hello: Hello,
    /// Byte offset of the next chunk.
    at: u64,
    chunk: Vec<u8>,
    /// Undecoded records of the current chunk: (offset in `chunk`, left).
    cur: (usize, u64),
    records: u64,
    done: bool,
}

impl<R: Read> CaptureReader<R> {
    pub fn new(mut r: R) -> Result<Self, CaptureError> {
        let mut m = [0u8; 8];
        let n = read_full(&mut r, &mut m)?;
        if n < m.len() || m[..7] != MAGIC[..7] {
            return Err(CaptureError::BadMagic(m[..n].to_vec()));
        }
        if !(OLDEST_FORMAT..=FORMAT).contains(&m[7]) {
            return Err(CaptureError::Format { got: m[7] });
        }
        let (mut at, mut chunk) = (MAGIC.len() as u64, Vec::new());
        let hello_at = at;
        if read_chunk(&mut r, &mut at, &mut chunk)? != Some(HELLO) {
            return Err(CaptureError::NoHello);
        }
        let hello: Hello = postcard::from_bytes(&chunk).map_err(|e| CaptureError::Malformed {
            at: hello_at,
            what: format!("hello: {e}"),
        })?;
        if !(OLDEST_VERSION..=PROTOCOL_VERSION).contains(&hello.protocol_version) {
            return Err(CaptureError::Version {
                got: hello.protocol_version,
                want: PROTOCOL_VERSION,
            });
        }
        Ok(CaptureReader {
            r,
            hello,
            at,
            chunk,
            cur: (0, 0),
            records: 0,
            done: false,
        })
    }

    fn next_chunk(&mut self) -> Result<Option<u8>, CaptureError> {
        read_chunk(&mut self.r, &mut self.at, &mut self.chunk)
    }

    fn next_item(&mut self) -> Result<Option<Item>, CaptureError> {
        loop {
            if self.done {
                return Ok(None);
            }
            let (off, left) = self.cur;
            if left > 0 {
                let chunk_at = self.at - self.chunk.len() as u64 - CHUNK_HEADER as u64;
                let bad = |what: String| CaptureError::Malformed { at: chunk_at, what };
                let (rec, rest) = postcard::take_from_bytes::<GuestRecord>(&self.chunk[off..])
                    .map_err(|e| bad(format!("record {} of the chunk: {e}", self.records)))?;
                let used = self.chunk.len() - off - rest.len();
                self.cur = (off + used, left - 1);
                if left == 1 && !rest.is_empty() {
                    return Err(bad(format!("{} bytes after its records", rest.len())));
                }
                self.records += 1;
                return Ok(Some(Item::Record(rec)));
            }
            let at = self.at;
            match self.next_chunk()? {
                None => {
                    return Err(CaptureError::NoEnd {
                        records: self.records,
                    })
                }
                Some(RECORDS) => {
                    let mut b = &self.chunk[..];
                    let n = varint::take(&mut b).ok_or_else(|| CaptureError::Malformed {
                        at,
                        what: "bad record count".into(),
                    })?;
                    if n == 0 || b.is_empty() {
                        return Err(CaptureError::Malformed {
                            at,
                            what: format!("{n} records in {} bytes", b.len()),
                        });
                    }
                    self.cur = (self.chunk.len() - b.len(), n);
                }
                Some(END) => {
                    self.done = true;
                    let line =
                        String::from_utf8(std::mem::take(&mut self.chunk)).map_err(|_| {
                            CaptureError::Malformed {
                                at,
                                what: "end chunk is not UTF-8".into(),
                            }
                        })?;
                    let mut rest = [0u8; 1];
                    if read_full(&mut self.r, &mut rest)? > 0 {
                        let mut tail = 1u64;
                        tail += io::copy(&mut self.r, &mut io::sink())?;
                        return Err(CaptureError::AfterEnd(tail));
                    }
                    return Ok(Some(Item::End(line)));
                }
                Some(kind) => return Err(CaptureError::UnknownChunk { at, kind }),
            }
        }
    }

    /// Records read so far.
    pub fn records(&self) -> u64 {
        self.records
    }
}

impl<R: Read> Iterator for CaptureReader<R> {
    type Item = Result<Item, CaptureError>;
    fn next(&mut self) -> Option<Self::Item> {
        match self.next_item() {
            Ok(x) => x.map(Ok),
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// Reads the chunk at byte `*at` of `r` into `chunk` and moves `*at` past it; its
/// kind, or None at the end of the input.
fn read_chunk<R: Read>(
    r: &mut R,
    at: &mut u64,
    chunk: &mut Vec<u8>,
) -> Result<Option<u8>, CaptureError> {
    let start = *at;
    let mut h = [0u8; CHUNK_HEADER];
    let n = read_full(r, &mut h)?;
    if n == 0 {
        return Ok(None);
    }
    if n < CHUNK_HEADER {
        return Err(CaptureError::Truncated {
            at: start,
            have: n,
            need: CHUNK_HEADER,
        });
    }
    let kind = h[0];
    if !matches!(kind, HELLO | RECORDS | END) {
        return Err(CaptureError::UnknownChunk { at: start, kind });
    }
    let len = u32::from_le_bytes(h[1..].try_into().expect("4 bytes")) as usize;
    if len > MAX_CHUNK {
        return Err(CaptureError::Oversized { at: start, len });
    }
    chunk.resize(len, 0);
    let got = read_full(r, chunk)?;
    if got < len {
        return Err(CaptureError::Truncated {
            at: start,
            have: CHUNK_HEADER + got,
            need: CHUNK_HEADER + len,
        });
    }
    *at += (CHUNK_HEADER + len) as u64;
    Ok(Some(kind))
}

/// Reads until `buf` is full or the end of the input; the bytes read.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Renders a capture as the JSON lines the writer would have printed with
/// `--json`: each record, then the final stats line. Returns the records
/// written; a capture that did not finish renders its records, then fails.
pub fn render_json<R: Read, W: Write>(
    rd: &mut CaptureReader<R>,
    out: &mut W,
) -> Result<u64, CaptureError> {
    let mut lines = crate::jsonl::JsonLines::new(out);
    let mut n = 0;
    for item in rd.by_ref() {
        match item? {
            Item::Record(GuestRecord::Rq(r)) => lines.write(&r)?,
            Item::Record(GuestRecord::Io(r)) => lines.write(&r)?,
            Item::End(line) => {
                lines.get_mut().write_all(line.as_bytes())?;
                continue;
            }
        }
        n += 1;
    }
    lines.flush()?;
    Ok(n)
}

#[cfg(test)]
#[path = "capture_tests.rs"]
mod tests;
