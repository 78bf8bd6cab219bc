//! A QEMU binary read where it lies: its headers and symbol tables through a
//! read cache, its code and data scanned in chunks, code windows read by
//! address. The whole file (15–25 MB) was read into memory before, and that
//! was the host agent's peak memory (27 MiB, against 9–13 MiB steady).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result};
use object::elf;
use object::read::elf::{ElfFile64, FileHeader, SectionHeader};
use object::read::ReadCache;
use object::{Endianness, Object, ObjectSection};

/// Bytes read per chunk of a scan.
const CHUNK: usize = 1 << 20;

/// An opened binary (what [`Bin`] borrows).
pub struct ElfSource {
    raw: File,
    cache: ReadCache<File>,
}

impl ElfSource {
    pub fn open(path: &Path) -> Result<ElfSource> {
        let raw = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let cache = ReadCache::new(raw.try_clone().context("duplicating the descriptor")?);
        Ok(ElfSource { raw, cache })
    }

    pub fn parse(&self, path: &Path) -> Result<Bin<'_>> {
        let elf = ElfFile64::<Endianness, _>::parse(&self.cache)
            .with_context(|| format!("parsing {} as a 64-bit ELF file", path.display()))?;
        Ok(Bin {
            elf,
            raw: &self.raw,
        })
    }
}

/// A parsed binary; its contents are read on demand.
pub struct Bin<'a> {
    pub elf: ElfFile64<'a, Endianness, &'a ReadCache<File>>,
    raw: &'a File,
}

impl Bin<'_> {
    /// `len` bytes of code at `addr` (fewer at the end of its section).
    pub fn code_at(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let sec = self.elf.sections().find(|s| {
            let (a, sz) = (s.address(), s.size());
            addr >= a && addr < a + sz
        })?;
        let (off, size) = sec.file_range()?;
        let skip = addr - sec.address();
        let len = (len as u64).min(size.checked_sub(skip)?);
        let mut buf = vec![0u8; usize::try_from(len).ok()?];
        self.raw.read_exact_at(&mut buf, off + skip).ok()?;
        Some(buf)
    }

    /// Calls `f(chunk, address, starts)` over the section's contents in
    /// chunks: each chunk also holds the first `overlap` bytes of the next, so
    /// that whatever starts in its first `starts` bytes can be read whole.
    pub fn scan_section<'d>(
        &self,
        sec: &impl ObjectSection<'d>,
        overlap: usize,
        f: impl FnMut(&[u8], u64, usize),
    ) -> io::Result<()> {
        match sec.file_range() {
            Some((off, size)) => self.scan(off, size, sec.address(), overlap, f),
            None => Ok(()),
        }
    }

    /// [`Self::scan_section`] over the whole file (addresses are file offsets).
    pub fn scan_file(&self, overlap: usize, f: impl FnMut(&[u8], u64, usize)) -> io::Result<()> {
        let size = self.raw.metadata()?.len();
        self.scan(0, size, 0, overlap, f)
    }

    fn scan(
        &self,
        off: u64,
        size: u64,
        addr: u64,
        overlap: usize,
        f: impl FnMut(&[u8], u64, usize),
    ) -> io::Result<()> {
        let read = |buf: &mut [u8], at: u64| self.raw.read_exact_at(buf, at);
        scan_chunks(read, (off, size, addr), CHUNK, overlap, f)
    }

    /// Calls `f` with the addend of every relocation the dynamic linker
    /// applies (the RELA sections linked to `.dynsym`), read in chunks.
    pub fn dynamic_addends(&self, mut f: impl FnMut(i64)) -> io::Result<()> {
        const RELA: usize = std::mem::size_of::<elf::Rela64<Endianness>>();
        let endian = self.elf.endian();
        let hdr = self.elf.elf_header();
        let Ok(sections) = hdr.sections(endian, self.elf.data()) else {
            return Ok(());
        };
        let Some(dynsym) = sections
            .iter()
            .position(|s| s.sh_type(endian) == elf::SHT_DYNSYM)
        else {
            return Ok(());
        };
        for sh in sections.iter() {
            let linked = sh.sh_link(endian) as usize == dynsym;
            if sh.sh_type(endian) != elf::SHT_RELA || !linked {
                continue;
            }
            let Some((off, size)) = sh.file_range(endian) else {
                continue;
            };
            // (chunks of whole entries, no overlap: CHUNK is not a multiple of 24)
            let read = |buf: &mut [u8], at: u64| self.raw.read_exact_at(buf, at);
            let range = (off, size - size % RELA as u64, 0);
            scan_chunks(read, range, CHUNK / RELA * RELA, 0, |b, _, _| {
                for e in b.chunks_exact(RELA) {
                    let a: [u8; 8] = e[16..24].try_into().expect("an entry is 24 bytes");
                    f(match endian {
                        Endianness::Little => i64::from_le_bytes(a),
                        Endianness::Big => i64::from_be_bytes(a),
                    });
                }
            })?;
        }
        Ok(())
    }
}

/// Reads `size` bytes at `off` (by `read`) in chunks of `chunk` bytes plus
/// `overlap` bytes of the next, calling `f(bytes, address, starts)`: the
/// address of the chunk's first byte (`addr` for the first chunk), and how
/// many of its bytes start there (the rest is the overlap).
pub fn scan_chunks(
    read: impl Fn(&mut [u8], u64) -> io::Result<()>,
    (off, size, addr): (u64, u64, u64),
    chunk: usize,
    overlap: usize,
    mut f: impl FnMut(&[u8], u64, usize),
) -> io::Result<()> {
    let mut buf = vec![0u8; chunk + overlap];
    let mut done = 0u64;
    while done < size {
        let starts = (size - done).min(chunk as u64) as usize;
        let have = (size - done).min((chunk + overlap) as u64) as usize;
        read(&mut buf[..have], off + done)?;
        f(&buf[..have], addr + done, starts);
        done += starts as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::binary::{count_code_refs, version_match, VERSION_MAX, VERSION_PAT};
    use super::*;

    /// Scanned in chunks of any size (with the overlap the readers ask for),
    /// code and version give what one pass over the whole range gives.
    #[test]
    fn chunked_scans_find_what_a_whole_pass_finds() {
        let base = 0x40_0000u64;
        let mut code = vec![0x90u8; 300];
        let targets: HashMap<u64, &str> = [(0x1000, "a"), (0x2000, "b")].into();
        for (at, t) in [
            (0usize, 0x1000u64),
            (63, 0x2000),
            (68, 0x1000),
            (200, 0x2000),
            (295, 0x1000),
        ] {
            code[at] = 0xe8;
            let d = (t as i64 - (base + at as u64 + 5) as i64) as i32;
            code[at + 1..at + 5].copy_from_slice(&d.to_le_bytes());
        }
        let text = b"QEMU emulator version 10.0.3+ds-1 (Debian)";
        code[120..120 + text.len()].copy_from_slice(text);
        let whole = count_code_refs(&code, base, code.len(), &targets);
        assert_eq!((whole.get("a"), whole.get("b")), (Some(&3), Some(&2)));
        let read = |buf: &mut [u8], at: u64| {
            buf.copy_from_slice(&code[at as usize..at as usize + buf.len()]);
            Ok(())
        };
        let range = (0u64, code.len() as u64, base);
        for chunk in [1usize, 5, 7, 31, 64, 65, 299, 300, 4096] {
            let mut refs: HashMap<&str, u32> = HashMap::new();
            scan_chunks(read, range, chunk, 6, |c, addr, starts| {
                for (name, n) in count_code_refs(c, addr, starts, &targets) {
                    *refs.entry(name).or_default() += n;
                }
            })
            .unwrap();
            assert_eq!(refs, whole, "chunks of {chunk}");
            let mut v = None;
            let overlap = VERSION_PAT.len() + VERSION_MAX;
            scan_chunks(read, range, chunk, overlap, |c, _, starts| {
                if v.is_none() {
                    v = version_match(c, starts).map(|m| m.1);
                }
            })
            .unwrap();
            assert_eq!(
                v.flatten().as_deref(),
                Some("10.0.3+ds-1"),
                "chunks of {chunk}"
            );
        }
    }
}
