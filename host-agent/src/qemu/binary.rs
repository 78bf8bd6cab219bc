//! What a QEMU binary offers: exported functions (`.dynsym`), the version string,
//! the structure layout (the release table, corrected and confirmed by the
//! machine code of the exported accessors), and which probe targets are really
//! called (LTO builds inline some exported functions into their callers).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{bail, Context, Result};
use object::{Object, ObjectSection, ObjectSymbol, SectionKind};

use super::decode::{accessor_returns, blk_field_from_calls, req_links_from_handle_vq, Returns};
use super::elf_file::{Bin, ElfSource};
use super::layout::{self, Basis, Layout, Version};
use super::probe_site::{self, Needs, Site};
use super::usdt::parse_stapsdt;

/// What a QEMU binary offers.
#[derive(Clone, Debug)]
pub struct BinaryInfo {
    pub version: Option<String>,
    /// Exported functions: name → address.
    pub symbols: HashMap<String, u64>,
    pub layout: Layout,
    pub basis: Basis,
    /// C names of the fields whose offsets the binary's own code confirmed.
    pub confirmed: Vec<&'static str>,
    /// Fields an accessor should have confirmed but could not (why).
    pub unconfirmed: Vec<String>,
    /// Table values the code contradicted (the code's value is used).
    pub corrected: Vec<String>,
    /// Exported probe targets that have no direct call site and whose address is
    /// never taken in the binary: a uprobe on them never fires.
    pub never_called: HashSet<String>,
    /// USDT probes of provider `qemu` (`.note.stapsdt`; dtrace-backend builds).
    pub usdt: HashSet<String>,
    /// Where each probe target's uprobe goes ([`probe_site`]). Absent: the entry.
    pub probe_sites: HashMap<String, Site>,
}

/// Where each probe target's uprobe goes in an x86-64 binary (see
/// [`probe_site`]): its site, and the site at its entry. A site past the entry
/// is kept only if no branch of the function lands in the bytes it skips (the
/// binary-wide check is [`never_called`]'s scan). Other architectures: the
/// entry, as libbpf places it.
fn probe_sites(
    bin: &Bin,
    symbols: &HashMap<String, u64>,
    sizes: &HashMap<String, u64>,
) -> HashMap<String, (Site, Site)> {
    if bin.elf.architecture() != object::Architecture::X86_64 {
        return HashMap::new();
    }
    PROBE_SYMBOLS
        .iter()
        .filter_map(|(s, _, _, needs)| {
            let addr = *symbols.get(*s)?;
            let size = sizes.get(*s).copied().unwrap_or(0);
            let len = usize::try_from(size).ok()?.max(probe_site::SCAN_BYTES);
            let code = bin.code_at(addr, len)?;
            let entry = probe_site::entry_site(&code, addr);
            // The function's own bytes: a site is looked for in them only (a
            // function of unknown size cannot be checked for branches: its entry).
            let body = &code[..usize::try_from(size).unwrap_or(0).min(code.len())];
            let mut site = probe_site::site_in(body, addr, *needs);
            if body.is_empty()
                || site.offset < entry.offset
                || (site.offset > entry.offset
                    && probe_site::branches_into(body, addr, entry.offset, site.offset))
            {
                site = entry.clone();
            }
            Some((s.to_string(), (site, entry)))
        })
        .collect()
}

/// The exported functions the probes use, what is lost without each (h.notify
/// and h.irq come from the queue's notifier eventfds, h.io_* and h.disk_* from
/// kernel tracepoints), whether only --pop uses it, and what its probe needs to
/// find at its site ([`probe_site::Needs`]: the arguments of QEMU's prototype
/// its BPF program reads, a bit per position; whether it follows a moved one,
/// bpf/host/host_qemu.h's `site_arg`; virtqueue_pop also has a return probe).
pub const PROBE_SYMBOLS: &[(&str, &str, bool, Needs)] = &[
    // (VirtQueue *, const VirtQueueElement *, unsigned int len): all three
    ("virtqueue_push", "every record (h.push)", false, Needs::reads(0b111)),
    // (BlockBackend *, int64_t offset, QEMUIOVector *, BdrvRequestFlags, cb, opaque):
    // the vector and opaque
    (
        "blk_aio_preadv",
        "h.submit and host I/O of reads",
        false,
        Needs::reads(0b10_0100).following(),
    ),
    (
        "blk_aio_pwritev",
        "h.submit and host I/O of writes",
        false,
        Needs::reads(0b10_0100).following(),
    ),
    // (BlockBackend *, cb, opaque): opaque
    (
        "blk_aio_flush",
        "h.submit and host I/O of flushes",
        false,
        Needs::reads(0b100).following(),
    ),
    // (BlockBackend *, int64_t offset, int64_t bytes, cb, opaque): bytes, opaque
    (
        "blk_aio_pdiscard",
        "h.submit of discards",
        false,
        Needs::reads(0b1_0100).following(),
    ),
    // (BlockBackend *, int64_t offset, int64_t bytes, BdrvRequestFlags, cb, opaque):
    // bytes, opaque
    (
        "blk_aio_pwrite_zeroes",
        "h.submit of write-zeroes",
        false,
        Needs::reads(0b10_0100).following(),
    ),
    // (VirtIODevice *, VirtQueue *): the queue
    (
        "virtio_notify",
        "h.irq where QEMU notifies without the guest notifier eventfd (8.2+ main-loop queues; probed with --irq)",
        false,
        Needs::reads(0b10),
    ),
    // (VirtQueue *, size_t sz): the queue; a uprobe and a uretprobe
    ("virtqueue_pop", "h.pop", true, Needs::reads(0b1).with_ret()),
    // (VirtIOBlock *, VirtQueue *): both
    (
        "virtio_blk_handle_vq",
        "h.pop of a queue's first requests",
        true,
        Needs::reads(0b11),
    ),
];

/// Accessor → what it reveals. `adjust` turns the accessor's offset into the
/// field's (vdev sits 8 bytes before guest_notifier; VirtIOBlock.blk follows
/// VirtIODevice, whose last member is config_notifier, 0x10 before its end).
struct Confirmation {
    accessor: &'static str,
    load: Option<u8>,
    fields: &'static [(&'static str, i64)],
    since: &'static str,
}

const CONFIRMATIONS: &[Confirmation] = &[
    Confirmation {
        accessor: "virtio_get_queue_index",
        load: Some(2),
        fields: &[("vq_queue_index", 0)],
        since: "",
    },
    Confirmation {
        accessor: "virtio_queue_get_guest_notifier",
        load: None,
        fields: &[("vq_guest_notifier", 0), ("vq_vdev", -8)],
        since: "",
    },
    Confirmation {
        accessor: "virtio_queue_get_host_notifier",
        load: None,
        fields: &[("vq_host_notifier", 0)],
        since: "",
    },
    Confirmation {
        accessor: "virtio_config_get_guest_notifier",
        load: None,
        fields: &[("vblk_blk", 0x10)],
        since: "; it exists since QEMU 8.0",
    },
    Confirmation {
        accessor: "blk_name",
        load: Some(8),
        fields: &[("blk_name", 0)],
        since: "",
    },
];

/// Bytes of code read per accessor.
const ACCESSOR_BYTES: usize = 64;

impl BinaryInfo {
    pub fn read(path: &Path) -> Result<BinaryInfo> {
        let src = ElfSource::open(path)?;
        let bin = src.parse(path)?;
        let mut symbols = HashMap::new();
        let mut sizes = HashMap::new();
        for s in bin.elf.dynamic_symbols() {
            if s.is_definition() && s.kind() == object::SymbolKind::Text {
                if let Ok(n) = s.name() {
                    symbols.insert(n.to_string(), s.address());
                    sizes.insert(n.to_string(), s.size());
                }
            }
        }
        if symbols.is_empty() {
            bail!("{} exports no functions in .dynsym", path.display());
        }
        let version =
            binary_version(&bin).with_context(|| format!("reading {}", path.display()))?;
        let (layout, basis) = layout::select(version.as_deref().and_then(Version::parse));
        let Confirmer {
            layout,
            confirmed,
            unconfirmed,
            corrected,
        } = confirm_layout(&bin, &symbols, layout);
        let mut probe_sites = probe_sites(&bin, &symbols, &sizes);
        let never_called = never_called(&bin, &symbols, &mut probe_sites)
            .with_context(|| format!("reading {}", path.display()))?;
        let usdt = bin
            .elf
            .section_by_name(".note.stapsdt")
            .and_then(|s| s.data().ok())
            .map(parse_stapsdt)
            .unwrap_or_default()
            .into_iter()
            .filter(|p| p.provider == "qemu")
            .map(|p| p.name)
            .collect();
        Ok(BinaryInfo {
            version,
            symbols,
            layout,
            basis,
            confirmed,
            unconfirmed,
            corrected,
            never_called,
            usdt,
            probe_sites: probe_sites
                .into_iter()
                .map(|(s, (site, _))| (s, site))
                .collect(),
        })
    }

    /// Bytes past `s`'s entry where its uprobe goes ([`probe_site`]).
    pub fn entry_offset(&self, s: &str) -> u64 {
        self.probe_sites.get(s).map_or(0, |site| site.offset)
    }

    /// `s`'s uprobe site, if known.
    pub fn probe_site(&self, s: &str) -> Option<&Site> {
        self.probe_sites.get(s)
    }

    pub fn has(&self, s: &str) -> bool {
        self.symbols.contains_key(s)
    }

    /// Exported and really called (a uprobe there fires).
    pub fn probeable(&self, s: &str) -> bool {
        self.has(s) && !self.never_called.contains(s)
    }

    /// Whether this QEMU may raise a queue's interrupt from `virtio_notify` without
    /// writing the queue's guest notifier eventfd: 8.2+ does on a queue served by
    /// the main loop (only an iothread's queue notifies through the eventfd;
    /// 10.2 also folds `virtio_notify_irqfd` into `virtio_notify`). Older builds
    /// (7.2: measured) notify virtio-blk queues through the eventfd. An unknown
    /// version is taken as a newer one.
    pub fn may_notify_without_eventfd(&self) -> bool {
        let old = self
            .version
            .as_deref()
            .and_then(Version::parse)
            .is_some_and(|v| v < Version(8, 2, 0));
        !old || !self.has("virtio_notify_irqfd")
    }

    /// What cannot be seen in this binary, as (symbol, what is lost, why).
    pub fn missing(&self, pop: bool) -> Vec<(&'static str, &'static str, &'static str)> {
        PROBE_SYMBOLS
            .iter()
            .filter(|(sym, _, only_pop, _)| (pop || !only_pop) && !self.probeable(sym))
            .map(|(sym, what, ..)| {
                let why = if self.has(sym) {
                    "has no call site in the binary (inlined by LTO)"
                } else {
                    "is not exported"
                };
                (*sym, *what, why)
            })
            .collect()
    }

    /// One line on which offsets are trusted and why.
    pub fn trust_note(&self) -> String {
        let mut s = format!("{}", self.basis);
        if !self.confirmed.is_empty() {
            s += &format!(
                "; confirmed from machine code: {}",
                self.confirmed.join(", ")
            );
        }
        if !self.corrected.is_empty() {
            s += &format!(
                "; corrected from machine code: {}",
                self.corrected.join("; ")
            );
        }
        if !self.unconfirmed.is_empty() {
            s += &format!("; not confirmed: {}", self.unconfirmed.join("; "));
        }
        if self.basis.trusted() {
            s += "; other offsets from the release table, checked on the first requests";
        } else {
            s += "; the other offsets are NOT known for this version: traced only if the \
                  check on the first requests passes";
        }
        s
    }
}

/// A layout being checked against the binary's code.
struct Confirmer {
    layout: Layout,
    confirmed: Vec<&'static str>,
    unconfirmed: Vec<String>,
    corrected: Vec<String>,
}

impl Confirmer {
    /// The code says field `key` is at `val` (`source` tells how it was read).
    fn apply(&mut self, key: &str, val: u32, source: &str) {
        let Some(f) = layout::field(key) else { return };
        if f.get(&self.layout) != Some(val) {
            self.corrected.push(format!(
                "{} at {val:#x} per {source} (table {:#x})",
                f.c_name,
                f.get(&self.layout).unwrap_or(0)
            ));
            layout::set_field(&mut self.layout, f, val);
        }
        self.confirmed.push(f.c_name);
    }
}

/// Confirms (or corrects) the offsets the binary's code reveals.
fn confirm_layout(bin: &Bin, symbols: &HashMap<String, u64>, layout: Layout) -> Confirmer {
    let mut c = Confirmer {
        layout,
        confirmed: Vec::new(),
        unconfirmed: Vec::new(),
        corrected: Vec::new(),
    };
    let code = |name: &str, len| bin.code_at(*symbols.get(name)?, len);
    // VirtIOBlock.blk from its users in virtio-blk's code: direct evidence,
    // preferred over config_notifier + 0x10 (which assumes config_notifier ends
    // VirtIODevice: not so in 11.1).
    let users = blk_from_users(bin, symbols);
    for a in CONFIRMATIONS {
        if a.accessor == "virtio_config_get_guest_notifier" && users.is_some() {
            continue;
        }
        let names = a
            .fields
            .iter()
            .filter_map(|(k, _)| layout::field(k).map(|f| f.c_name))
            .collect::<Vec<_>>()
            .join(", ");
        let Some(bytes) = code(a.accessor, ACCESSOR_BYTES) else {
            let why = format!("{names} ({} not exported{})", a.accessor, a.since);
            c.unconfirmed.push(why);
            continue;
        };
        let off = match (accessor_returns(&bytes), a.load) {
            (Some(Returns::Addr(d)), None) => d,
            (Some(Returns::Load { off, size }), Some(want)) if size == want => off,
            (other, _) => {
                let why = format!(
                    "{names} ({} is not a plain accessor: {other:?})",
                    a.accessor
                );
                c.unconfirmed.push(why);
                continue;
            }
        };
        for (key, adj) in a.fields {
            match u32::try_from(i64::from(off) + adj) {
                Ok(v) => c.apply(key, v, a.accessor),
                Err(_) => c.unconfirmed.push(format!("{key} (offset out of range)")),
            }
        }
    }
    // VirtIOBlockReq.dev/.vq from the request set-up in virtio_blk_handle_vq.
    match code("virtio_blk_handle_vq", 0x400).and_then(|b| req_links_from_handle_vq(&b)) {
        Some((d, v)) => {
            c.apply("req_dev", d, "virtio_blk_handle_vq");
            c.apply("req_vq", v, "virtio_blk_handle_vq");
        }
        None => c.unconfirmed.push(
            "VirtIOBlockReq.dev, VirtIOBlockReq.vq (no request set-up found in \
             virtio_blk_handle_vq)"
                .into(),
        ),
    }
    if let Some((v, hits)) = users {
        c.apply(
            "vblk_blk",
            v,
            &format!("{hits} blk_* calls in virtio-blk code"),
        );
    }
    c
}

/// VirtIOBlock.blk as virtio-blk's own functions use it: the code around
/// virtio_blk_handle_vq (hw/block/virtio-blk.c's static functions lie next to it),
/// from the first exported function at most 16 KiB before it to 16 KiB after it.
fn blk_from_users(bin: &Bin, symbols: &HashMap<String, u64>) -> Option<(u32, u32)> {
    const WINDOW: u64 = 0x4000;
    let anchor = *symbols.get("virtio_blk_handle_vq")?;
    let start = symbols
        .values()
        .copied()
        .filter(|&a| a + WINDOW >= anchor && a <= anchor)
        .min()?;
    let code = bin.code_at(start, usize::try_from(anchor + WINDOW - start).ok()?)?;
    let blk_fns: HashSet<u64> = symbols
        .iter()
        .filter(|(n, _)| n.starts_with("blk_"))
        .map(|(_, a)| *a)
        .collect();
    blk_field_from_calls(&code, start, |t| blk_fns.contains(&t), 0x180..0x400, 3)
}

/// The probe targets that nothing in the binary calls or takes the address of.
/// The same scan moves back to its entry a probe whose site past the entry a
/// `rel32` branch from elsewhere may land before ([`probe_site::interior_refs`]).
fn never_called(
    bin: &Bin,
    symbols: &HashMap<String, u64>,
    sites: &mut HashMap<String, (Site, Site)>,
) -> std::io::Result<HashSet<String>> {
    let targets: HashMap<u64, &str> = PROBE_SYMBOLS
        .iter()
        .filter_map(|(s, ..)| Some((*symbols.get(*s)?, *s)))
        .collect();
    let ranges: HashMap<&str, (u64, u64)> = PROBE_SYMBOLS
        .iter()
        .filter_map(|(s, ..)| {
            let a = *symbols.get(*s)?;
            let (site, entry) = sites.get(*s)?;
            (site.offset > entry.offset).then_some((*s, (a + entry.offset, a + site.offset)))
        })
        .collect();
    let mut refs: HashMap<&str, u32> = HashMap::new();
    let mut entered: HashSet<&str> = HashSet::new();
    for sec in bin.elf.sections() {
        if sec.kind() != SectionKind::Text {
            continue;
        }
        // (an instruction that starts in a chunk ends in its 6-byte overlap)
        bin.scan_section(&sec, 6, |code, addr, starts| {
            for (name, n) in count_code_refs(code, addr, starts, &targets) {
                *refs.entry(name).or_default() += n;
            }
            entered.extend(probe_site::interior_refs(code, addr, starts, &ranges));
        })?;
    }
    for name in entered {
        if let Some((site, entry)) = sites.get_mut(name) {
            *site = entry.clone();
        }
    }
    // Function pointers in data (PIE: R_X86_64_RELATIVE addends).
    bin.dynamic_addends(|a| {
        if let Some(name) = u64::try_from(a).ok().and_then(|a| targets.get(&a)) {
            *refs.entry(name).or_default() += 1;
        }
    })?;
    Ok(targets
        .values()
        .filter(|n| refs.get(*n).copied().unwrap_or(0) == 0)
        .map(|n| n.to_string())
        .collect())
}

/// Counts, per target, the `call rel32` / `jmp rel32` instructions and the
/// RIP-relative `lea` (address taken) that reach it in a code section at `base`,
/// among the instructions that start in its first `starts` bytes.
/// A byte scan: a false hit needs an exact 32-bit displacement match.
pub fn count_code_refs<'a>(
    code: &[u8],
    base: u64,
    starts: usize,
    targets: &HashMap<u64, &'a str>,
) -> HashMap<&'a str, u32> {
    let mut out = HashMap::new();
    // disp32 at `disp_at`, instruction ends at `end`: target = base + end + disp.
    let rel = |disp_at: usize, end: usize| probe_site::rel32_target(code, base, disp_at, end);
    for i in 0..starts.min(code.len()) {
        let t = match code[i] {
            // call/jmp rel32: target = next instruction + rel32
            0xe8 | 0xe9 => rel(i + 1, i + 5),
            // lea r64, [rip+disp32]: REX.W (48/4c) 8d modrm(mod=00, rm=101)
            0x48 | 0x4c
                if code.get(i + 1) == Some(&0x8d)
                    && code.get(i + 2).is_some_and(|m| m & 0xc7 == 0x05) =>
            {
                rel(i + 3, i + 7)
            }
            _ => None,
        };
        if let Some(name) = t.and_then(|t| targets.get(&t)) {
            *out.entry(*name).or_default() += 1;
        }
    }
    out
}

pub(super) const VERSION_PAT: &[u8] = b"QEMU emulator version ";
/// Bytes a version match reads past its pattern.
pub(super) const VERSION_MAX: usize = 32;

/// `QEMU emulator version X.Y.Z …` in the binary's read-only data: the
/// first `QEMU emulator version ` that starts in `data`'s first `starts`
/// bytes, and the version after it (None: no number follows).
pub(super) fn version_match(data: &[u8], starts: usize) -> Option<(usize, Option<String>)> {
    let pos = data
        .windows(VERSION_PAT.len())
        .take(starts)
        .position(|w| w == VERSION_PAT)?;
    let rest = &data[pos + VERSION_PAT.len()..];
    let end = rest
        .iter()
        .position(|&b| b == 0 || b == b'\n' || b == b' ')
        .unwrap_or(rest.len().min(VERSION_MAX));
    let v = std::str::from_utf8(&rest[..end]).ok();
    let v = v.filter(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()));
    Some((pos, v.map(str::to_string)))
}

/// The version string, from `.rodata` (where it is), else from anywhere in
/// the file; read in chunks.
fn binary_version(bin: &Bin) -> std::io::Result<Option<String>> {
    fn look(found: &mut Option<Option<String>>, d: &[u8], starts: usize) {
        if found.is_none() {
            *found = version_match(d, starts).map(|m| m.1);
        }
    }
    let overlap = VERSION_PAT.len() + VERSION_MAX;
    let mut found = None;
    if let Some(sec) = bin.elf.section_by_name(".rodata") {
        bin.scan_section(&sec, overlap, |d, _, starts| look(&mut found, d, starts))?;
    }
    if found.is_none() {
        bin.scan_file(overlap, |d, _, starts| look(&mut found, d, starts))?;
    }
    Ok(found.flatten())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A binary of `version` exporting `symbols`, with its release table's layout.
    fn info_of(version: Option<&str>, symbols: HashMap<String, u64>) -> BinaryInfo {
        let (layout, basis) = layout::select(version.and_then(Version::parse));
        BinaryInfo {
            version: version.map(String::from),
            symbols,
            layout,
            basis,
            confirmed: vec![],
            unconfirmed: vec![],
            corrected: vec![],
            never_called: HashSet::new(),
            usdt: HashSet::new(),
            probe_sites: HashMap::new(),
        }
    }

    #[test]
    fn reports_missing_and_uncalled_symbols() {
        let all: HashMap<String, u64> = PROBE_SYMBOLS
            .iter()
            .enumerate()
            .map(|(i, s)| (s.0.to_string(), i as u64))
            .collect();
        let mut info = info_of(Some("7.2.22"), all);
        assert!(info.missing(true).is_empty());
        info.symbols.remove("blk_aio_flush");
        info.symbols.remove("virtqueue_pop");
        assert_eq!(
            info.missing(false),
            vec![(
                "blk_aio_flush",
                "h.submit and host I/O of flushes",
                "is not exported"
            )]
        );
        assert_eq!(info.missing(true).len(), 2);
        info.never_called.insert("blk_aio_preadv".into());
        assert!(!info.probeable("blk_aio_preadv"));
        assert!(info
            .missing(false)
            .iter()
            .any(|m| m.0 == "blk_aio_preadv"
                && m.2 == "has no call site in the binary (inlined by LTO)"));
    }

    #[test]
    fn which_builds_may_notify_without_an_eventfd() {
        let info = |version: Option<&str>, irqfd: bool| {
            let mut symbols = HashMap::new();
            if irqfd {
                symbols.insert("virtio_notify_irqfd".to_string(), 1);
            }
            info_of(version, symbols)
        };
        assert!(!info(Some("7.2.22"), true).may_notify_without_eventfd());
        assert!(!info(Some("8.1.5"), true).may_notify_without_eventfd());
        assert!(info(Some("7.2.22"), false).may_notify_without_eventfd());
        assert!(info(Some("8.2.2"), true).may_notify_without_eventfd());
        assert!(info(Some("10.0.2"), true).may_notify_without_eventfd());
        assert!(info(Some("11.1.3"), false).may_notify_without_eventfd());
        assert!(info(None, true).may_notify_without_eventfd());
    }

    #[test]
    fn the_code_wins_over_the_table() {
        let (layout, _) = layout::select(Version::parse("11.1.3"));
        let mut c = Confirmer {
            layout,
            confirmed: vec![],
            unconfirmed: vec![],
            corrected: vec![],
        };
        c.apply("vblk_blk", 0x228, "x");
        assert!(c.corrected.is_empty());
        c.apply("vq_vdev", 0x68, "virtio_queue_get_guest_notifier");
        assert_eq!(c.layout.vq_vdev, 0x68);
        assert_eq!(
            c.corrected,
            vec!["VirtQueue.vdev at 0x68 per virtio_queue_get_guest_notifier (table 0x60)"]
        );
        assert_eq!(c.confirmed, vec!["VirtIOBlock.blk", "VirtQueue.vdev"]);
    }

    #[test]
    fn finds_version() {
        let d = b"xx\0QEMU emulator version 7.2.22 (Debian 1:7.2)\nCopyright";
        let find = |d: &[u8]| version_match(d, d.len()).and_then(|m| m.1);
        assert_eq!(find(d).as_deref(), Some("7.2.22"));
        assert_eq!(find(b"nothing"), None);
        // The pattern without a number after it: no version.
        assert_eq!(find(b"QEMU emulator version %s"), None);
    }

    /// A code range laid out at 0x1000: a call to `a`, a tail jump to `b`, a
    /// lea taking the address of `c`, and `d` never referenced (as an LTO build
    /// leaves an exported blk_aio_preadv whose callers inlined it).
    #[test]
    fn call_site_scan_on_a_byte_range() {
        let base = 0x1000u64;
        let mut code = vec![0x90u8; 64];
        let put = |code: &mut Vec<u8>, at: usize, ins: &[u8], len: usize, target: u64| {
            code[at..at + ins.len()].copy_from_slice(ins);
            let next = base + (at + len) as u64;
            let d = (target as i64 - next as i64) as i32;
            code[at + ins.len()..at + ins.len() + 4].copy_from_slice(&d.to_le_bytes());
        };
        let (a, b, c, d) = (0x2000u64, 0x0800u64, 0x3000u64, 0x4000u64);
        put(&mut code, 0, &[0xe8], 5, a); // call a
        put(&mut code, 10, &[0xe9], 5, b); // jmp b (backwards)
        put(&mut code, 20, &[0x48, 0x8d, 0x05], 7, c); // lea rax,[rip+c]
        put(&mut code, 30, &[0x4c, 0x8d, 0x0d], 7, a); // lea r9,[rip+a]
        let targets: HashMap<u64, &str> = [(a, "a"), (b, "b"), (c, "c"), (d, "d")].into();
        let refs = count_code_refs(&code, base, code.len(), &targets);
        assert_eq!(refs.get("a"), Some(&2));
        assert_eq!(refs.get("b"), Some(&1));
        assert_eq!(refs.get("c"), Some(&1));
        assert_eq!(refs.get("d"), None);
        // Truncated instruction at the end of the range: no read past it.
        let tail = [0xe8u8, 0x00, 0x10];
        assert!(count_code_refs(&tail, base, tail.len(), &targets).is_empty());
    }
}

/// The machine's own QEMU (scripts/setup.sh installs Debian's qemu-system-x86,
/// which the lab needs anyway): every accessor confirms, every probe target is
/// called, and the table row is the one of its version.
#[cfg(test)]
mod host_binary {
    use super::*;

    #[test]
    fn reads_the_installed_qemu() {
        let p = Path::new("/usr/bin/qemu-system-x86_64");
        assert!(p.exists(), "install qemu-system-x86 (scripts/setup.sh)");
        let info = BinaryInfo::read(p).unwrap();
        let extra = std::env::var("VIOTRACE_TEST_QEMU").ok();
        for b in std::iter::once(info).chain(
            extra
                .iter()
                .flat_map(|s| s.split(':'))
                .map(|x| BinaryInfo::read(Path::new(x)).unwrap()),
        ) {
            eprintln!(
                "{:?}: {}; never called: {:?}",
                b.version,
                b.trust_note(),
                b.never_called
            );
            assert!(
                b.unconfirmed.iter().all(|u| u.contains("not exported")),
                "{:?}",
                b.unconfirmed
            );
            assert!(b.corrected.is_empty(), "{:?}", b.corrected);
            assert!(b.confirmed.contains(&"VirtQueue.queue_index"));
            assert!(b.confirmed.contains(&"VirtQueue.vdev"));
            assert!(
                b.confirmed.contains(&"VirtIOBlock.blk"),
                "{:?}",
                b.confirmed
            );
            assert!(b.never_called.is_empty(), "{:?}", b.never_called);
        }
    }
}
