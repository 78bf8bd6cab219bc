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
            let size = size - size % RELA as u64;
            // (chunks of whole entries: CHUNK is not a multiple of 24)
            let per = (CHUNK / RELA * RELA) as u64;
            let mut buf = vec![0u8; per as usize];
            let mut done = 0;
            while done < size {
                let n = (size - done).min(per) as usize;
                self.raw.read_exact_at(&mut buf[..n], off + done)?;
                for e in buf[..n].chunks_exact(RELA) {
                    let a: [u8; 8] = e[16..24].try_into().expect("an entry is 24 bytes");
                    f(match endian {
                        Endianness::Little => i64::from_le_bytes(a),
                        Endianness::Big => i64::from_be_bytes(a),
                    });
                }
                done += n as u64;
            }
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
