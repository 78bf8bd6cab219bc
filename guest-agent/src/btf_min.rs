//! The part of the kernel's BTF the agent uses, as a file of the same shape.
//!
//! libbpf looks into the kernel's BTF for three things here: the CO-RE
//! relocations (kernel types named like the BPF object's own types, flavours
//! stripped), the attach targets (the `FUNC` of each fentry/fexit program and
//! the `btf_trace_*` typedef of each tp_btf one, passed to the kernel by type
//! id) and the agent's start-up facts (tracepoint and syscall prototypes, by
//! name). The minimized copy keeps, each at its own id:
//! - every type whose name is one of the wanted names, and every type those
//!   reach, except that a named struct or union whose name is not wanted is
//!   kept hollow (its name, kind and size, no members: nothing looks inside);
//! - likewise every vmlinux type a module's BTF refers to (module BTF is split
//!   BTF on top of vmlinux: its type ids and string offsets continue vmlinux's).
//!
//! Every other type becomes an anonymous `void *` (12 bytes), so that type ids
//! do not change. The string section keeps its length and every offset (module
//! BTF points into it); only the strings that kept types and modules use are
//! written, the rest of it is a hole in a sparse file.
//!
//! The kernel's BTF is read in a few sequential passes and small reads: the
//! agent holds an index of 4 bytes per type, never the BTF itself.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

const MAGIC: u16 = 0xeb9f;
const HDR_LEN: usize = 24;

const KIND_PTR: u32 = 2;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

/// Why no minimized copy was made (the agent then copies the whole BTF).
#[derive(Debug, thiserror::Error)]
pub enum MinError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("unexpected BTF: {0}")]
    Format(String),
}

fn format<T>(what: impl Into<String>) -> Result<T, MinError> {
    Err(MinError::Format(what.into()))
}

/// The layout of a BTF blob (offsets relative to the end of its header).
#[derive(Clone, Copy, Debug)]
struct Header {
    type_off: u32,
    type_len: u32,
    str_off: u32,
    str_len: u32,
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    b.get(i..i + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .unwrap_or(0)
}

fn header(b: &[u8; HDR_LEN]) -> Result<Header, MinError> {
    let magic = u16::from_le_bytes([b[0], b[1]]);
    if magic != MAGIC {
        return format(format!("magic {magic:#x} (not little-endian BTF)"));
    }
    if b[2] != 1 {
        return format(format!("version {}", b[2]));
    }
    if u32_at(b, 4) as usize != HDR_LEN {
        return format(format!("header of {} bytes", u32_at(b, 4)));
    }
    Ok(Header {
        type_off: u32_at(b, 8),
        type_len: u32_at(b, 12),
        str_off: u32_at(b, 16),
        str_len: u32_at(b, 20),
    })
}

fn read_header(f: &File) -> Result<Header, MinError> {
    let mut b = [0u8; HDR_LEN];
    f.read_exact_at(&mut b, 0)?;
    header(&b)
}

/// One type record: its 12-byte common part and what its kind appends.
struct Rec<'a>(&'a [u8]);

impl Rec<'_> {
    fn name_off(&self) -> u32 {
        u32_at(self.0, 0)
    }
    fn kind(&self) -> u32 {
        (u32_at(self.0, 4) >> 24) & 0x1f
    }
    fn vlen(&self) -> usize {
        (u32_at(self.0, 4) & 0xffff) as usize
    }

    /// The type ids this record refers to.
    fn refs(&self, mut f: impl FnMut(u32)) {
        let b = self.0;
        match self.kind() {
            // PTR, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, VAR, DECL_TAG, TYPE_TAG
            2 | 8..=12 | 14 | 17 | 18 => f(u32_at(b, 8)),
            3 => {
                f(u32_at(b, 12));
                f(u32_at(b, 16));
            }
            4 | 5 => (0..self.vlen()).for_each(|k| f(u32_at(b, 12 + 12 * k + 4))),
            13 => {
                f(u32_at(b, 8));
                (0..self.vlen()).for_each(|k| f(u32_at(b, 12 + 8 * k + 4)));
            }
            15 => (0..self.vlen()).for_each(|k| f(u32_at(b, 12 + 12 * k))),
            _ => {}
        }
    }

    /// The string offsets this record uses.
    fn strings(&self, mut f: impl FnMut(u32)) {
        let b = self.0;
        f(self.name_off());
        let step = match self.kind() {
            4 | 5 | 19 => 12, // members, 64-bit enumerators
            6 | 13 => 8,      // enumerators, parameters
            _ => return,
        };
        (0..self.vlen()).for_each(|k| f(u32_at(b, 12 + step * k)));
    }
}

/// Bytes a record of `kind` with `vlen` entries takes after its common part.
fn extra_len(kind: u32, vlen: usize) -> Result<usize, MinError> {
    Ok(match kind {
        1 | 14 | 17 => 4,             // INT, VAR, DECL_TAG
        3 => 12,                      // ARRAY
        4 | 5 | 15 | 19 => 12 * vlen, // STRUCT, UNION, DATASEC, ENUM64
        6 | 13 => 8 * vlen,           // ENUM, FUNC_PROTO
        2 | 7..=12 | 16 | 18 => 0,
        k => return format(format!("type kind {k}")),
    })
}

/// Calls `f(id, record)` for each type of a type section read from `r`.
fn each_record<R: Read>(
    mut r: R,
    len: u32,
    first_id: u32,
    mut f: impl FnMut(u32, u32, &Rec<'_>),
) -> Result<(), MinError> {
    let mut buf = Vec::with_capacity(256);
    let (mut pos, mut id) = (0u32, first_id);
    while pos < len {
        buf.resize(12, 0);
        r.read_exact(&mut buf)?;
        let rec = Rec(&buf);
        let extra = extra_len(rec.kind(), rec.vlen())?;
        buf.resize(12 + extra, 0);
        r.read_exact(&mut buf[12..])?;
        f(id, pos, &Rec(&buf));
        pos = pos
            .checked_add(buf.len() as u32)
            .filter(|&p| p <= len)
            .map_or_else(|| format("a type runs past its section"), Ok)?;
        id += 1;
    }
    Ok(())
}

/// libbpf's essential name: `name` up to its last `___flavour` suffix.
pub fn essential(name: &[u8]) -> &[u8] {
    let n = name.len();
    (0..n.saturating_sub(4))
        .rev()
        .find(|&i| {
            name[i] != b'_'
                && name[i + 1..i + 4] == *b"___"
                && name.get(i + 4).is_some_and(|&c| c != b'_')
        })
        .map_or(name, |i| &name[..=i])
}

/// Calls `f(offset, string)` for each NUL-terminated string of a section.
fn each_string<R: BufRead>(mut r: R, mut f: impl FnMut(u32, &[u8])) -> Result<(), MinError> {
    let mut s = Vec::new();
    let mut pos = 0u32;
    loop {
        s.clear();
        let n = r.read_until(0, &mut s)?;
        if n == 0 {
            return Ok(());
        }
        f(pos, s.strip_suffix(&[0]).unwrap_or(&s));
        pos += n as u32;
    }
}

/// The names of the named types of an in-memory BTF blob (a BPF object's
/// `.BTF` section), flavours stripped: what its CO-RE relocations look up.
pub fn local_type_names(btf: &[u8]) -> Result<HashSet<String>, MinError> {
    let hb: &[u8; HDR_LEN] = btf
        .get(..HDR_LEN)
        .and_then(|h| h.try_into().ok())
        .map_or_else(|| format("short BTF"), Ok)?;
    let h = header(hb)?;
    let section = |off: u32, len: u32| {
        let start = HDR_LEN + off as usize;
        btf.get(start..start + len as usize)
            .map_or_else(|| format("a section runs past the BTF"), Ok)
    };
    let (types, strs) = (
        section(h.type_off, h.type_len)?,
        section(h.str_off, h.str_len)?,
    );
    let mut offs = HashSet::new();
    each_record(types, h.type_len, 1, |_, _, r| {
        // STRUCT, UNION, ENUM, FWD, TYPEDEF, ENUM64
        if matches!(r.kind(), 4..=8 | 19) && r.name_off() != 0 {
            offs.insert(r.name_off());
        }
    })?;
    let mut names = HashSet::new();
    each_string(strs, |off, s| {
        if offs.contains(&off) {
            names.insert(String::from_utf8_lossy(essential(s)).into_owned());
        }
    })?;
    Ok(names)
}

/// A set of type ids.
struct Ids(Vec<u64>);

impl Ids {
    fn new(n: usize) -> Ids {
        Ids(vec![0; n / 64 + 1])
    }
    fn has(&self, id: u32) -> bool {
        self.0
            .get(id as usize / 64)
            .is_some_and(|w| w >> (id % 64) & 1 == 1)
    }
    fn add(&mut self, id: u32) {
        if let Some(w) = self.0.get_mut(id as usize / 64) {
            *w |= 1 << (id % 64);
        }
    }
}

/// What [`minimize`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    pub types: u32,
    pub whole: u32,
    pub hollow: u32,
    /// Bytes of the original and of the copy (its holes not counted).
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// The vmlinux BTF at `src`, read with `pread`: index and closure state.
struct Source {
    f: File,
    h: Header,
    /// Type section offset of each id (index 0: id 1), and the section's end.
    offs: Vec<u32>,
    whole: Ids,
    hollow: Ids,
    /// Offsets of the strings naming a wanted type.
    wanted: HashSet<u32>,
    /// Offsets of the strings the copy keeps.
    strings: Vec<u32>,
    buf: Vec<u8>,
}

impl Source {
    /// Indexes the BTF at `path`; returns it with the types named one of `names`.
    fn open(path: &Path, names: &HashSet<String>) -> Result<(Source, Vec<u32>), MinError> {
        let f = File::open(path)?;
        let h = read_header(&f)?;
        let section = |off: u32, len: u32| -> Result<_, MinError> {
            let mut r = BufReader::with_capacity(64 << 10, f.try_clone()?);
            r.seek(SeekFrom::Start((HDR_LEN as u64) + u64::from(off)))?;
            Ok(r.take(u64::from(len)))
        };
        let mut wanted = HashSet::new();
        each_string(section(h.str_off, h.str_len)?, |off, s| {
            if std::str::from_utf8(essential(s)).is_ok_and(|e| names.contains(e)) {
                wanted.insert(off);
            }
        })?;
        let (mut offs, mut roots) = (Vec::new(), Vec::new());
        each_record(
            section(h.type_off, h.type_len)?,
            h.type_len,
            1,
            |id, pos, rec| {
                offs.push(pos);
                if wanted.contains(&rec.name_off()) {
                    roots.push(id);
                }
            },
        )?;
        offs.push(h.type_len);
        let n = offs.len();
        let src = Source {
            f,
            h,
            offs,
            whole: Ids::new(n),
            hollow: Ids::new(n),
            wanted,
            strings: Vec::new(),
            buf: Vec::new(),
        };
        Ok((src, roots))
    }

    /// The number of types (ids 1..=n).
    fn n(&self) -> u32 {
        self.offs.len() as u32 - 1
    }

    /// Reads type `id`'s record into `self.buf`.
    fn read(&mut self, id: u32) -> Result<(), MinError> {
        let i = id as usize - 1;
        let (a, b) = (self.offs[i], self.offs[i + 1]);
        self.buf.resize((b - a) as usize, 0);
        let at = HDR_LEN as u64 + u64::from(self.h.type_off) + u64::from(a);
        self.f.read_exact_at(&mut self.buf, at)?;
        Ok(())
    }

    /// Marks what `seeds` reach: whole, or hollow for unwanted named structs and unions.
    fn close_over(&mut self, mut stack: Vec<u32>) -> Result<(), MinError> {
        let n = self.n();
        while let Some(id) = stack.pop() {
            if id == 0 || id > n || self.whole.has(id) || self.hollow.has(id) {
                continue;
            }
            self.read(id)?;
            let rec = Rec(&self.buf);
            let composite = matches!(rec.kind(), KIND_STRUCT | KIND_UNION);
            if composite && rec.name_off() != 0 && !self.wanted.contains(&rec.name_off()) {
                self.hollow.add(id);
                self.strings.push(rec.name_off());
                continue;
            }
            self.whole.add(id);
            rec.refs(|t| stack.push(t));
            rec.strings(|s| self.strings.push(s));
        }
        Ok(())
    }

    /// Seeds from a module's split BTF: the vmlinux types and strings it uses.
    fn module_seeds(&mut self, path: &Path, seeds: &mut Vec<u32>) -> Result<(), MinError> {
        let f = File::open(path)?;
        let h = read_header(&f)?;
        let mut r = BufReader::with_capacity(16 << 10, f);
        r.seek(SeekFrom::Start(HDR_LEN as u64 + u64::from(h.type_off)))?;
        let (n, str_len) = (self.n(), self.h.str_len);
        let strings = &mut self.strings;
        each_record(
            r.take(u64::from(h.type_len)),
            h.type_len,
            n + 1,
            |_, _, rec| {
                rec.refs(|t| {
                    if t != 0 && t <= n {
                        seeds.push(t)
                    }
                });
                rec.strings(|s| {
                    if s < str_len {
                        strings.push(s)
                    }
                });
            },
        )
    }

    /// Writes the copy to `out`; returns its size without holes.
    fn write(&mut self, out: &File) -> Result<u64, MinError> {
        let n = self.n();
        let mut type_len = 0u32;
        for id in 1..=n {
            type_len += if self.whole.has(id) {
                self.offs[id as usize] - self.offs[id as usize - 1]
            } else {
                12
            };
        }
        let mut w = BufWriter::with_capacity(64 << 10, out.try_clone()?);
        w.write_all(&MAGIC.to_le_bytes())?;
        w.write_all(&[1, 0])?; // version, flags
        for v in [HDR_LEN as u32, 0, type_len, type_len, self.h.str_len] {
            w.write_all(&v.to_le_bytes())?;
        }
        let mut written = HDR_LEN as u64 + u64::from(type_len);
        for id in 1..=n {
            if self.whole.has(id) {
                self.read(id)?;
                w.write_all(&self.buf)?;
                continue;
            }
            let (name, info, size) = if self.hollow.has(id) {
                self.read(id)?;
                let r = Rec(&self.buf);
                (r.name_off(), r.kind() << 24, u32_at(&self.buf, 8))
            } else {
                (0, KIND_PTR << 24, 0) // void *
            };
            for v in [name, info, size] {
                w.write_all(&v.to_le_bytes())?;
            }
        }
        w.flush()?;
        drop(w);
        let str_at = HDR_LEN as u64 + u64::from(type_len);
        out.set_len(str_at + u64::from(self.h.str_len))?;
        written += self.copy_strings(out, str_at)?;
        Ok(written)
    }

    /// Writes the kept strings at their offsets from `at`; returns the bytes written.
    fn copy_strings(&mut self, out: &File, at: u64) -> Result<u64, MinError> {
        self.strings.sort_unstable();
        self.strings.dedup();
        let mut r = BufReader::with_capacity(64 << 10, self.f.try_clone()?);
        r.seek(SeekFrom::Start(HDR_LEN as u64 + u64::from(self.h.str_off)))?;
        let (keep, mut next) = (&self.strings, 0usize);
        // Runs of adjacent kept strings, each written at once.
        let (mut run, mut run_at, mut written) = (Vec::new(), 0u32, 0u64);
        let mut result = Ok(());
        each_string(r.take(u64::from(self.h.str_len)), |off, s| {
            let end = off + s.len() as u32 + 1;
            while next < keep.len() && keep[next] < off {
                next += 1;
            }
            if next >= keep.len() || keep[next] >= end || off == 0 {
                return; // (offset 0, the empty string, is already a zero byte)
            }
            if run_at + run.len() as u32 != off && !run.is_empty() {
                written += run.len() as u64;
                if result.is_ok() {
                    result = out.write_all_at(&run, at + u64::from(run_at));
                }
                run.clear();
            }
            if run.is_empty() {
                run_at = off;
            }
            run.extend_from_slice(s);
            run.push(0);
        })?;
        result?;
        out.write_all_at(&run, at + u64::from(run_at))?;
        Ok(written + run.len() as u64)
    }
}

/// Writes to `out` the minimized copy of the vmlinux BTF at `vmlinux` for
/// `names`, given the module BTFs at `modules` (see the module comment).
pub fn minimize(
    vmlinux: &Path,
    modules: &[std::path::PathBuf],
    names: &HashSet<String>,
    out: &File,
) -> Result<Summary, MinError> {
    let (mut src, mut seeds) = Source::open(vmlinux, names)?;
    for m in modules {
        src.module_seeds(m, &mut seeds)?;
    }
    src.close_over(seeds)?;
    let bytes_out = src.write(out)?;
    let (n, whole, hollow) = (src.n(), &src.whole, &src.hollow);
    let count = |s: &Ids| (1..=n).filter(|&i| s.has(i)).count() as u32;
    Ok(Summary {
        types: n,
        whole: count(whole),
        hollow: count(hollow),
        bytes_in: HDR_LEN as u64 + u64::from(src.h.type_len) + u64::from(src.h.str_len),
        bytes_out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::ViotraceGuestSkelBuilder;
    use libbpf_rs::btf::BtfType;
    use libbpf_rs::skel::{OpenSkel, SkelBuilder};
    use libbpf_rs::{AsRawLibbpf, Btf};
    use std::mem::MaybeUninit;
    use std::sync::Mutex;

    const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

    /// What the agent asks for: its object's names and its start-up facts'.
    fn names() -> HashSet<String> {
        let mut n = crate::embedded::btf_names().expect("the embedded object's names");
        n.extend(crate::kernel::btf_names());
        n
    }

    /// This machine's vmlinux BTF minimized into a file of `tag`'s name.
    fn minimized(tag: &str) -> Option<(std::path::PathBuf, Summary)> {
        if !Path::new(VMLINUX).exists() {
            eprintln!("no {VMLINUX}: nothing to minimize here");
            return None;
        }
        let path = std::env::temp_dir().join(format!("viotrace-btf-{tag}.{}", std::process::id()));
        let out = File::create(&path).unwrap();
        let s = minimize(Path::new(VMLINUX), &[], &names(), &out).expect("minimize");
        Some((path, s))
    }

    #[test]
    fn essential_names_strip_the_last_flavour_only() {
        assert_eq!(essential(b"request_queue___new"), b"request_queue");
        assert_eq!(essential(b"bio___old___x"), b"bio___old");
        assert_eq!(essential(b"task_struct"), b"task_struct");
        assert_eq!(essential(b"a____b"), b"a____b"); // four underscores: no flavour
        assert_eq!(essential(b"___x"), b"___x");
    }

    /// A damaged or foreign BTF is an error (the agent then copies the whole), not a panic.
    #[test]
    fn bad_btf_is_an_error() {
        let dir = std::env::temp_dir();
        let (src, out) = (
            dir.join(format!("viotrace-bad-btf.{}", std::process::id())),
            dir.join(format!("viotrace-bad-btf-out.{}", std::process::id())),
        );
        let mut hdr = vec![0x9f, 0xeb, 1, 0, 24, 0, 0, 0];
        // types 0..40 (one INT claims 16 bytes, then a record runs past), strings 40..44
        for v in [0u32, 40, 40, 4] {
            hdr.extend_from_slice(&v.to_le_bytes());
        }
        let mut rec = Vec::new();
        for v in [0u32, 1 << 24, 4, 32] {
            rec.extend_from_slice(&v.to_le_bytes()); // INT
        }
        for v in [0u32, 4 << 24 | 3, 8] {
            rec.extend_from_slice(&v.to_le_bytes()); // STRUCT of 3 members: 48 bytes
        }
        rec.resize(40, 0);
        let cases: [(&str, Vec<u8>); 3] = [
            ("magic", b"not btf at all, not at all".to_vec()),
            ("short", hdr[..10].to_vec()),
            ("past", [hdr.clone(), rec, b"\0ab\0".to_vec()].concat()),
        ];
        let names = HashSet::from(["x".to_string()]);
        for (what, bytes) in cases {
            std::fs::write(&src, bytes).unwrap();
            let o = File::create(&out).unwrap();
            let r = minimize(&src, &[], &names, &o);
            assert!(r.is_err(), "{what}: {r:?}");
        }
        let _ = std::fs::remove_file(&src);
        let _ = std::fs::remove_file(&out);
    }

    #[test]
    fn the_object_asks_for_its_types_and_attach_targets() {
        let n = names();
        for want in [
            "request",
            "bio",
            "task_struct",
            "request_queue",
            "virtio_queue_rq",
        ] {
            assert!(n.contains(want), "{want} not asked for");
        }
        assert!(n.contains("btf_trace_block_bio_queue"));
        assert!(n.iter().all(|s| !s.contains("___")), "flavours kept: {n:?}");
    }

    /// Same ids, kinds and names for everything the agent looks up; sizes and
    /// members of its types; and far fewer bytes.
    #[test]
    fn the_minimized_btf_keeps_every_wanted_type_at_its_id() {
        let Some((path, s)) = minimized("ids") else {
            return;
        };
        let (full, min) = (
            Btf::from_path(VMLINUX).unwrap(),
            Btf::from_path(&path).unwrap(),
        );
        std::fs::remove_file(&path).unwrap();
        assert_eq!(full.len(), min.len());
        assert_eq!(s.types as usize + 1, full.len());
        let (mut found, wanted) = (0, names());
        for id in 1..full.len() as u32 {
            let f: BtfType<'_> = full.type_by_id(id.into()).unwrap();
            let Some(name) = f.name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !wanted.contains(std::str::from_utf8(essential(name.as_bytes())).unwrap()) {
                continue;
            }
            let m: BtfType<'_> = min.type_by_id(id.into()).unwrap();
            assert_eq!((m.kind(), m.name()), (f.kind(), f.name()), "type {id}");
            let (fb, mb) = (raw(&full, id), raw(&min, id));
            assert_eq!(fb, mb, "type {id} ({name}) differs");
            found += 1;
        }
        eprintln!("{found} wanted types; {s:?}");
        assert!(found > 100, "only {found} wanted types");
        assert!(s.whole as usize >= found && s.hollow > 0, "{s:?}");
        assert!(s.bytes_out * 2 < s.bytes_in, "{s:?}");
    }

    /// Type `id`'s record as libbpf holds it.
    fn raw(btf: &Btf<'_>, id: u32) -> Vec<u8> {
        let p = btf.as_libbpf_object().as_ptr();
        // SAFETY: `id` is a type of this BTF (checked by the caller's
        // type_by_id): libbpf returns its record, at least 12 bytes.
        let common = unsafe {
            let t = libbpf_rs::libbpf_sys::btf__type_by_id(p, id);
            std::slice::from_raw_parts(t.cast::<u8>(), 12)
        };
        let rec = Rec(common);
        let len = 12 + extra_len(rec.kind(), rec.vlen()).unwrap();
        // SAFETY: the same record, whose kind and vlen give its length.
        unsafe {
            let t = libbpf_rs::libbpf_sys::btf__type_by_id(p, id);
            std::slice::from_raw_parts(t.cast::<u8>(), len)
        }
        .to_vec()
    }

    static LOG: Mutex<Vec<String>> = Mutex::new(Vec::new());

    /// CO-RE relocation lines (`prog '…': relo #…`), which only a load prints
    /// (other tests may open the object meanwhile: its ELF `sec '…': relo #` lines).
    fn keep_relo_lines(_: libbpf_rs::PrintLevel, msg: String) {
        if msg.starts_with("libbpf: prog '") && msg.contains(": relo #") {
            LOG.lock().unwrap().push(msg);
        }
    }

    /// libbpf's CO-RE relocations of every program, against `btf`: its log lines.
    fn relocations(btf: &Path) -> Vec<String> {
        let path = std::ffi::CString::new(btf.as_os_str().as_encoded_bytes()).unwrap();
        let opts = libbpf_rs::libbpf_sys::bpf_object_open_opts {
            sz: size_of::<libbpf_rs::libbpf_sys::bpf_object_open_opts>() as _,
            btf_custom_path: path.as_ptr(),
            ..Default::default()
        };
        let mut storage = MaybeUninit::uninit();
        let mut open = ViotraceGuestSkelBuilder::default()
            .open_opts(opts, &mut storage)
            .expect("open the embedded object");
        for mut p in open.open_object_mut().progs_mut() {
            p.set_autoload(true);
        }
        LOG.lock().unwrap().clear();
        libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, keep_relo_lines)));
        // (programs this kernel cannot load fail after every relocation is done)
        let _ = open.load();
        libbpf_rs::set_print(None);
        std::mem::take(&mut *LOG.lock().unwrap())
    }

    /// Every CO-RE relocation of every program resolves the same on the
    /// minimized BTF as on the whole one (the same candidates, ids and offsets).
    #[test]
    fn core_relocations_are_the_same_on_the_minimized_btf() {
        let Some((path, _)) = minimized("core") else {
            return;
        };
        let min = relocations(&path);
        let full = relocations(Path::new(VMLINUX));
        std::fs::remove_file(&path).unwrap();
        eprintln!("{} relocation lines", full.len());
        assert!(full.len() > 200, "only {} relocation lines", full.len());
        assert_eq!(min.len(), full.len());
        for (m, f) in min.iter().zip(&full) {
            assert_eq!(m, f);
        }
    }
}
