//! The BPF object is embedded in the agent's binary (the skeleton's bytes, in
//! section `.bpf.objs`, about 0.5 MiB). libbpf reads it once, while opening, and
//! keeps copies of what it needs; from then on those pages are only resident
//! memory. They are handed back before the load, where the agent's memory peaks
//! (libbpf then also maps the kernel's BTF, 4 MiB and more).

use std::collections::HashSet;
use std::fs::File;

use object::elf::{PF_W, PT_LOAD};
use object::read::elf::{ElfFile64, FileHeader, ProgramHeader};
use object::read::ReadCache;
use object::{Object, ObjectSection};

const SECTION: &str = ".bpf.objs";

/// Why the embedded object could not be read, or its pages handed back (the
/// agent works the same).
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("reading /proc/self/exe: {0}")]
    Io(#[from] std::io::Error),
    #[error("parsing /proc/self/exe: {0}")]
    Elf(#[from] object::Error),
    #[error("{0}")]
    Layout(&'static str),
    #[error("madvise: {0}")]
    Madvise(nix::errno::Errno),
    #[error("the BPF object's BTF: {0}")]
    Btf(#[from] crate::btf_min::MinError),
}

/// Hands the embedded object's whole pages back to the kernel; returns the
/// bytes released. The section lies in a read-only segment mapped from the
/// binary: a later read would fault the same bytes back in from the file.
pub fn release_object_pages() -> Result<usize, ObjectError> {
    let cache = ReadCache::new(File::open("/proc/self/exe")?);
    let elf = ElfFile64::<object::Endianness, _>::parse(&cache)?;
    let sec = elf
        .section_by_name(SECTION)
        .ok_or(ObjectError::Layout("no .bpf.objs section"))?;
    let (addr, size) = (sec.address(), sec.size());
    let endian = elf.endian();
    let phoff = elf.elf_header().e_phoff(endian);
    let mut phdr_vaddr = None;
    let mut read_only = false;
    for ph in elf.elf_program_headers() {
        if ph.p_type(endian) != PT_LOAD {
            continue;
        }
        let (vaddr, off) = (ph.p_vaddr(endian), ph.p_offset(endian));
        let (memsz, filesz) = (ph.p_memsz(endian), ph.p_filesz(endian));
        if (off..off + filesz).contains(&phoff) {
            phdr_vaddr = Some(vaddr + (phoff - off));
        }
        if vaddr <= addr && addr + size <= vaddr + memsz {
            read_only = !ph.p_flags(endian).contains(PF_W);
        }
    }
    // Discarding pages of a writable segment would lose what was written.
    if !read_only {
        return Err(ObjectError::Layout(
            ".bpf.objs is not in a read-only loaded segment",
        ));
    }
    let phdr_vaddr = phdr_vaddr.ok_or(ObjectError::Layout(
        "program headers not in a loaded segment",
    ))?;
    // SAFETY: getauxval only reads the process's auxiliary vector.
    let at_phdr = unsafe { libc::getauxval(libc::AT_PHDR) };
    if at_phdr == 0 {
        return Err(ObjectError::Layout("no AT_PHDR"));
    }
    let bias = at_phdr.wrapping_sub(phdr_vaddr);
    let page = 4096u64;
    let start = (bias.wrapping_add(addr) + page - 1) & !(page - 1);
    let end = bias.wrapping_add(addr + size) & !(page - 1);
    if end <= start {
        return Ok(0);
    }
    let len = (end - start) as usize;
    // SAFETY: [start, end) is whole pages of this binary's read-only segment
    // (checked above), a private mapping of the file that is never written: the
    // kernel drops the pages and a later access reads the same bytes from the
    // file. No Rust value lives there other than the skeleton's constant bytes.
    let r = unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
    if r != 0 {
        return Err(ObjectError::Madvise(nix::errno::Errno::last()));
    }
    Ok(len)
}

/// What the embedded object looks up in the kernel's BTF, by name: its own
/// named types (flavours stripped, as its CO-RE relocations match them), the
/// function of each fentry/fexit program and the `btf_trace_*` typedef of each
/// tp_btf and raw_tp one. Read from the binary's file, not its mapped pages.
pub fn btf_names() -> Result<HashSet<String>, ObjectError> {
    let cache = ReadCache::new(File::open("/proc/self/exe")?);
    let elf = ElfFile64::<object::Endianness, _>::parse(&cache)?;
    let (off, size) = elf
        .section_by_name(SECTION)
        .and_then(|s| s.file_range())
        .ok_or(ObjectError::Layout("no .bpf.objs section in the file"))?;
    let obj = ElfFile64::<object::Endianness, _>::parse(cache.range(off, size))?;
    let btf = obj
        .section_by_name(".BTF")
        .ok_or(ObjectError::Layout("the BPF object has no .BTF"))?
        .data()?;
    let mut names = crate::btf_min::local_type_names(btf)?;
    for sec in obj.sections() {
        let name = sec.name()?.trim_start_matches('?');
        let Some((kind, target)) = name.split_once('/') else {
            continue;
        };
        match kind {
            "fentry" | "fexit" | "fmod_ret" | "fentry.s" | "fexit.s" => {
                names.insert(target.to_string());
            }
            "tp_btf" | "raw_tp" | "raw_tracepoint" => {
                names.insert(format!("btf_trace_{target}"));
            }
            _ => {}
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf::ViotraceGuestSkelBuilder;
    use libbpf_rs::skel::{OpenSkel, SkelBuilder};
    use std::mem::MaybeUninit;

    /// The pages go back, and the object still opens afterwards (its bytes are
    /// read from the file again): the same programs as before.
    #[test]
    fn object_pages_are_released_and_read_back_intact() {
        let names = || {
            let mut storage = MaybeUninit::uninit();
            let open = ViotraceGuestSkelBuilder::default()
                .open(&mut storage)
                .expect("open the embedded BPF object");
            open.open_object()
                .progs()
                .map(|p| p.name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        };
        let before = names();
        let released = release_object_pages().expect("release the object's pages");
        // the object is ~0.5 MiB: all but its two partial pages
        assert!(released > 256 * 1024, "released only {released} bytes");
        assert_eq!(released % 4096, 0);
        assert_eq!(names(), before);
        assert!(before.len() > 30);
    }
}
