//! Finding QEMU processes and learning what can be traced in them: command line
//! (VM name, virtio-blk devices, drives and their aio backend), exported symbols
//! (ELF `.dynsym`), version string and the private structure layouts we read.

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use object::{Object, ObjectSection, ObjectSymbol};
use viotrace_shared::record::Backend;

/// A QEMU process we may trace.
#[derive(Clone, Debug)]
pub struct QemuProc {
    pub pid: u32,
    /// The binary the uprobes attach to (resolved `/proc/PID/exe`).
    pub exe: PathBuf,
    /// VM label: `-name`, else `qemu-<pid>`.
    pub vm: String,
    pub devices: Vec<BlkDevice>,
    pub drives: Vec<Drive>,
}

/// A `-device virtio-blk-*` from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkDevice {
    pub id: Option<String>,
    pub drive: Option<String>,
    pub num_queues: Option<u16>,
}

/// A `-drive` or `-blockdev` from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drive {
    pub id: String,
    pub backend: Backend,
    pub format: Option<String>,
}

/// Whether `pid` runs a `qemu-system-*` binary.
pub fn is_qemu(pid: u32) -> bool {
    fs::read_link(format!("/proc/{pid}/exe"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .is_some_and(|n| n.starts_with("qemu-system-"))
}

/// Every running `qemu-system-*` process.
pub fn discover() -> Vec<u32> {
    let Ok(rd) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut v: Vec<u32> = rd
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| is_qemu(pid))
        .collect();
    v.sort_unstable();
    v
}

/// Whether the process still exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X"),
        Err(_) => false,
    }
}

impl QemuProc {
    pub fn inspect(pid: u32) -> Result<QemuProc> {
        let link = fs::read_link(format!("/proc/{pid}/exe"))
            .with_context(|| format!("reading /proc/{pid}/exe"))?;
        // A replaced binary shows as "… (deleted)": attach through /proc then.
        let exe = if link.exists() {
            link
        } else {
            PathBuf::from(format!("/proc/{pid}/exe"))
        };
        let raw = fs::read(format!("/proc/{pid}/cmdline"))
            .with_context(|| format!("reading /proc/{pid}/cmdline"))?;
        let args: Vec<String> = raw
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let cl = parse_cmdline(&args);
        Ok(QemuProc {
            pid,
            exe,
            vm: cl.name.unwrap_or_else(|| format!("qemu-{pid}")),
            devices: cl.devices,
            drives: cl.drives,
        })
    }

    /// The backend of a device (by its drive), or of the only drive.
    pub fn backend_of(&self, dev: Option<&BlkDevice>) -> Backend {
        let drive = dev.and_then(|d| d.drive.as_deref());
        if let Some(id) = drive {
            if let Some(d) = self.drives.iter().find(|d| d.id == id) {
                return d.backend;
            }
        }
        // Unknown drive: still known when every drive uses the same mode.
        match self.drives.split_first() {
            Some((first, rest)) if rest.iter().all(|d| d.backend == first.backend) => first.backend,
            _ => Backend::Unknown,
        }
    }
}

#[derive(Debug, Default, PartialEq)]
pub struct Cmdline {
    pub name: Option<String>,
    pub devices: Vec<BlkDevice>,
    pub drives: Vec<Drive>,
}

/// Splits a QEMU option string `a=b,c=d` (`,,` escapes a comma). A leading bare
/// value becomes key `""`.
fn opts(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut parts = Vec::new();
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c == ',' {
            if it.peek() == Some(&',') {
                it.next();
                cur.push(',');
            } else {
                parts.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    parts.push(cur);
    for (i, p) in parts.into_iter().enumerate() {
        match p.split_once('=') {
            Some((k, v)) => out.push((k.to_string(), v.to_string())),
            None if i == 0 => out.push((String::new(), p)),
            None => out.push((p, "on".to_string())),
        }
    }
    out
}

fn get<'a>(o: &'a [(String, String)], k: &str) -> Option<&'a str> {
    o.iter()
        .rev()
        .find(|(kk, _)| kk == k)
        .map(|(_, v)| v.as_str())
}

fn backend_from(aio: Option<&str>) -> Backend {
    match aio {
        None | Some("threads") => Backend::Threads,
        Some("native") => Backend::Native,
        Some("io_uring") => Backend::IoUring,
        Some(_) => Backend::Unknown,
    }
}

/// Extracts the parts of a QEMU command line we need.
pub fn parse_cmdline(args: &[String]) -> Cmdline {
    let mut cl = Cmdline::default();
    let mut anon = 0;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].trim_start_matches('-');
        let is_opt = args[i].starts_with('-');
        let val = args.get(i + 1).map(String::as_str);
        if !is_opt || val.is_none() {
            i += 1;
            continue;
        }
        let val = val.unwrap_or_default();
        match a {
            "name" => {
                let o = opts(val);
                cl.name = get(&o, "guest").or_else(|| get(&o, "")).map(str::to_string);
            }
            "device" => {
                let o = opts(val);
                let drv = get(&o, "driver").or_else(|| get(&o, "")).unwrap_or("");
                if drv.starts_with("virtio-blk") {
                    cl.devices.push(BlkDevice {
                        id: get(&o, "id").map(str::to_string),
                        drive: get(&o, "drive").map(str::to_string),
                        num_queues: get(&o, "num-queues").and_then(|v| v.parse().ok()),
                    });
                }
            }
            "drive" => {
                let o = opts(val);
                let id = get(&o, "id").map(str::to_string).unwrap_or_else(|| {
                    anon += 1;
                    format!("drive{}", anon - 1)
                });
                cl.drives.push(Drive {
                    id,
                    backend: backend_from(get(&o, "aio")),
                    format: get(&o, "format").map(str::to_string),
                });
            }
            "blockdev" => cl.drives.extend(parse_blockdev(val)),
            _ => {}
        }
        i += 2;
    }
    cl
}

/// `-blockdev` in key=value or JSON form. The aio mode lives on the protocol
/// (file) node; the device names the top node, so every node in the tree is
/// listed with the aio of the file node below it.
fn parse_blockdev(val: &str) -> Vec<Drive> {
    if val.trim_start().starts_with('{') {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(val) else {
            return Vec::new();
        };
        fn walk(v: &serde_json::Value) -> Option<String> {
            if let Some(a) = v.get("aio").and_then(|a| a.as_str()) {
                return Some(a.to_string());
            }
            v.get("file").and_then(walk)
        }
        let aio = walk(&v);
        let mut out = Vec::new();
        let mut cur = Some(&v);
        while let Some(n) = cur {
            if let Some(name) = n.get("node-name").and_then(|x| x.as_str()) {
                out.push(Drive {
                    id: name.to_string(),
                    backend: backend_from(aio.as_deref()),
                    format: n.get("driver").and_then(|x| x.as_str()).map(str::to_string),
                });
            }
            cur = n.get("file").filter(|f| f.is_object());
        }
        return out;
    }
    let o = opts(val);
    let aio = get(&o, "aio").or_else(|| get(&o, "file.aio"));
    get(&o, "node-name")
        .map(|n| Drive {
            id: n.to_string(),
            backend: backend_from(aio),
            format: get(&o, "driver").map(str::to_string),
        })
        .into_iter()
        .collect()
}

/// Offsets into QEMU's private structures (see bpf/host/viotrace_host.bpf.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub vq_queue_index: u32,
    pub vq_guest_notifier: u32,
    pub vq_host_notifier: u32,
    pub vq_vdev: u32,
    pub elem_index: u32,
    pub elem_out_num: u32,
    pub elem_in_num: u32,
    pub elem_in_sg: u32,
    pub elem_out_sg: u32,
    pub req_dev: u32,
    pub req_vq: u32,
    pub req_in: u32,
    pub req_out: u32,
    pub req_qiov_size: u32,
    pub req_mr_next: u32,
    pub qiov_size: u32,
    pub luring_sqe: u32,
    /// VirtIOBlock.blk (BlockBackend *); BlockBackend.name (the drive id).
    pub vblk_blk: u32,
    pub blk_name: u32,
}

/// Layouts read from the QEMU sources of each release and checked against the
/// Debian binary's machine code (see `decode_*`). Keyed by "major.minor".
const KNOWN_LAYOUTS: &[(&str, Layout)] = &[(
    "7.2",
    Layout {
        // struct VirtQueue: VRing (48) + used_elems, then the u16/bool fields,
        // vector, handle_output, vdev, guest_notifier, host_notifier (EventNotifier
        // { rfd, wfd, initialized }).
        vq_queue_index: 0x48,
        vq_vdev: 0x60,
        vq_guest_notifier: 0x68,
        vq_host_notifier: 0x74,
        // struct VirtQueueElement: index, len, ndescs, out_num, in_num, in_addr,
        // out_addr, in_sg, out_sg.
        elem_index: 0,
        elem_out_num: 12,
        elem_in_num: 16,
        elem_in_sg: 40,
        elem_out_sg: 48,
        // struct VirtIOBlockReq: elem (56), sector_num, dev, vq (0x48), inhdr_undo,
        // outhdr_undo, in (0x80), out (0x88), qiov (0x98, 40), in_len, next, mr_next.
        req_dev: 0x40,
        req_vq: 0x48,
        req_in: 0x80,
        req_out: 0x88,
        req_qiov_size: 0x98 + 32,
        req_mr_next: 0xd0,
        // QEMUIOVector { iov; niov; union { { nalloc; local_iov }, { pad; size } } }
        qiov_size: 32,
        // struct LuringAIOCB: Coroutine *co; struct io_uring_sqe sqeq; …
        luring_sqe: 8,
        // struct VirtIOBlock { VirtIODevice parent_obj; BlockBackend *blk; … }
        vblk_blk: 0x200,
        // struct BlockBackend { char *name; … } (blk_name())
        blk_name: 0,
    },
)];

/// What a QEMU binary offers.
#[derive(Clone, Debug)]
pub struct BinaryInfo {
    pub version: Option<String>,
    pub symbols: HashSet<String>,
    pub layout: Option<Layout>,
    /// Why the layout is missing or was adjusted.
    pub layout_note: String,
}

/// The exported functions the probes use and what is lost without each (h.notify
/// and h.irq come from the queue's notifier eventfds, h.io_* and h.disk_* from
/// kernel tracepoints). `pop`: only used with --pop.
pub const PROBE_SYMBOLS: &[(&str, &str, bool)] = &[
    ("virtqueue_push", "every record (h.push)", false),
    ("blk_aio_preadv", "h.submit and host I/O of reads", false),
    ("blk_aio_pwritev", "h.submit and host I/O of writes", false),
    ("blk_aio_flush", "h.submit and host I/O of flushes", false),
    ("blk_aio_pdiscard", "h.submit of discards", false),
    ("blk_aio_pwrite_zeroes", "h.submit of write-zeroes", false),
    (
        "virtio_notify",
        "h.irq on the non-dataplane notification path",
        false,
    ),
    ("virtqueue_pop", "h.pop", true),
    (
        "virtio_blk_handle_vq",
        "h.pop of a queue's first requests",
        true,
    ),
];

impl BinaryInfo {
    pub fn read(path: &Path) -> Result<BinaryInfo> {
        let data = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let file = object::File::parse(&*data)
            .with_context(|| format!("parsing ELF {}", path.display()))?;
        let mut symbols = HashSet::new();
        let mut addrs = BTreeMap::new();
        for s in file.dynamic_symbols() {
            if s.is_definition() && s.kind() == object::SymbolKind::Text {
                if let Ok(n) = s.name() {
                    symbols.insert(n.to_string());
                    addrs.insert(n.to_string(), s.address());
                }
            }
        }
        if symbols.is_empty() {
            bail!("{} exports no functions in .dynsym", path.display());
        }
        let version = find_version(&data);
        let code = |name: &str| -> Option<Vec<u8>> {
            let addr = *addrs.get(name)?;
            for sec in file.sections() {
                let (a, sz) = (sec.address(), sec.size());
                if addr >= a && addr + 8 <= a + sz {
                    let d = sec.data().ok()?;
                    let off = usize::try_from(addr - a).ok()?;
                    return d.get(off..off + 8).map(<[u8]>::to_vec);
                }
            }
            None
        };
        let qi = code("virtio_get_queue_index").and_then(|c| decode_movzwl_rdi(&c));
        let gn = code("virtio_queue_get_guest_notifier").and_then(|c| decode_lea_rdi(&c));
        let hn = code("virtio_queue_get_host_notifier").and_then(|c| decode_lea_rdi(&c));
        let mm = version
            .as_deref()
            .and_then(|v| {
                let mut it = v.split('.');
                Some(format!("{}.{}", it.next()?, it.next()?))
            })
            .unwrap_or_default();
        let (layout, layout_note) = match KNOWN_LAYOUTS.iter().find(|(k, _)| *k == mm) {
            Some((_, l)) => {
                let mut l = *l;
                let mut note = format!("layout for QEMU {mm}");
                match qi {
                    Some(o) if o != l.vq_queue_index => {
                        note += &format!(
                            "; VirtQueue.queue_index at {o:#x} per virtio_get_queue_index (table {:#x})",
                            l.vq_queue_index
                        );
                        l.vq_queue_index = o;
                    }
                    Some(_) => note += "; queue_index offset confirmed from code",
                    None => note += "; queue_index offset not confirmed from code",
                }
                if let Some(o) = gn {
                    if o != l.vq_guest_notifier {
                        note += &format!("; guest_notifier at {o:#x} per code");
                        l.vq_guest_notifier = o;
                    }
                }
                if let Some(o) = hn {
                    if o != l.vq_host_notifier {
                        note += &format!("; host_notifier at {o:#x} per code");
                        l.vq_host_notifier = o;
                    }
                }
                (Some(l), note)
            }
            None => (
                None,
                format!(
                    "no known structure layout for QEMU {} (known: {})",
                    version.as_deref().unwrap_or("of unknown version"),
                    KNOWN_LAYOUTS
                        .iter()
                        .map(|(k, _)| *k)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
        };
        Ok(BinaryInfo {
            version,
            symbols,
            layout,
            layout_note,
        })
    }

    pub fn has(&self, s: &str) -> bool {
        self.symbols.contains(s)
    }

    /// What cannot be seen in this binary, as (symbol, what is lost).
    pub fn missing(&self, pop: bool) -> Vec<(&'static str, &'static str)> {
        PROBE_SYMBOLS
            .iter()
            .filter(|(sym, _, only_pop)| (pop || !only_pop) && !self.has(sym))
            .map(|(sym, what, _)| (*sym, *what))
            .collect()
    }
}

/// `QEMU emulator version X.Y.Z …` from the binary's read-only data.
fn find_version(data: &[u8]) -> Option<String> {
    const PAT: &[u8] = b"QEMU emulator version ";
    let pos = data.windows(PAT.len()).position(|w| w == PAT)?;
    let rest = &data[pos + PAT.len()..];
    let end = rest
        .iter()
        .position(|&b| b == 0 || b == b'\n' || b == b' ')
        .unwrap_or(rest.len().min(32));
    let v = std::str::from_utf8(&rest[..end]).ok()?;
    (v.chars().next()?.is_ascii_digit()).then(|| v.to_string())
}

/// `movzwl disp8(%rdi),%eax; ret` → disp8.
fn decode_movzwl_rdi(c: &[u8]) -> Option<u32> {
    match c {
        [0x0f, 0xb7, 0x47, d, 0xc3, ..] => Some(u32::from(*d)),
        [0x0f, 0xb7, 0x87, a, b, cc, dd, 0xc3, ..] => Some(u32::from_le_bytes([*a, *b, *cc, *dd])),
        _ => None,
    }
}

/// `lea disp8(%rdi),%rax; ret` → disp8.
fn decode_lea_rdi(c: &[u8]) -> Option<u32> {
    match c {
        [0x48, 0x8d, 0x47, d, 0xc3, ..] => Some(u32::from(*d)),
        [0x48, 0x8d, 0x87, a, b, cc, dd, 0xc3, ..] => Some(u32::from_le_bytes([*a, *b, *cc, *dd])),
        _ => None,
    }
}

/// Reads `len` bytes of the process's memory.
pub fn read_mem(pid: u32, addr: u64, len: usize) -> Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = fs::File::open(format!("/proc/{pid}/mem"))
        .with_context(|| format!("opening /proc/{pid}/mem"))?;
    f.seek(SeekFrom::Start(addr))?;
    let mut buf = vec![0u8; len];
    f.read_exact(&mut buf)
        .with_context(|| format!("reading {len} bytes at {addr:#x} in {pid}"))?;
    Ok(buf)
}

fn read_ptr(pid: u32, addr: u64) -> Option<u64> {
    let b = read_mem(pid, addr, 8).ok()?;
    Some(u64::from_le_bytes(b.try_into().ok()?))
}

fn read_cstr(pid: u32, addr: u64) -> Option<String> {
    // Small chunks: a longer read could run into an unmapped page.
    let mut out = Vec::new();
    for k in 0..8u64 {
        let b = read_mem(pid, addr + k * 16, 16).ok()?;
        match b.iter().position(|&c| c == 0) {
            Some(end) => {
                out.extend_from_slice(&b[..end]);
                let s = String::from_utf8(out).ok()?;
                return (!s.is_empty() && s.chars().all(|c| c.is_ascii_graphic())).then_some(s);
            }
            None => out.extend_from_slice(&b),
        }
    }
    None
}

/// The drive (BlockBackend name, i.e. the `-drive id=`) behind a virtio-blk device.
pub fn device_drive(pid: u32, vdev: u64, l: &Layout) -> Option<String> {
    if vdev == 0 {
        return None;
    }
    let blk = read_ptr(pid, vdev + u64::from(l.vblk_blk)).filter(|&p| p != 0)?;
    let name = read_ptr(pid, blk + u64::from(l.blk_name)).filter(|&p| p != 0)?;
    read_cstr(pid, name)
}

/// utime + stime of a process, in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // after ")": state is field 3 → index 0; utime field 14 → index 11
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn parses_lab_cmdline() {
        let cl = parse_cmdline(&s(&[
            "qemu-system-x86_64",
            "-name",
            "viotrace-lab",
            "-drive",
            "file=/x/d.qcow2,if=none,id=data,format=qcow2,aio=io_uring,cache=writeback",
            "-device",
            "virtio-blk-pci,drive=data,id=vdata,num-queues=2",
            "-device",
            "virtio-serial-pci,id=vser",
        ]));
        assert_eq!(cl.name.as_deref(), Some("viotrace-lab"));
        assert_eq!(
            cl.devices,
            vec![BlkDevice {
                id: Some("vdata".into()),
                drive: Some("data".into()),
                num_queues: Some(2)
            }]
        );
        assert_eq!(cl.drives[0].backend, Backend::IoUring);
        assert_eq!(cl.drives[0].format.as_deref(), Some("qcow2"));
    }

    #[test]
    fn parses_name_guest_and_defaults() {
        let cl = parse_cmdline(&s(&[
            "q",
            "-name",
            "guest=vm1,debug-threads=on",
            "-drive",
            "file=a,,b.img,if=none",
            "-blockdev",
            r#"{"driver":"raw","node-name":"top","file":{"driver":"file","filename":"x","aio":"native"}}"#,
            "-blockdev",
            "driver=file,node-name=f2,filename=y,aio=io_uring",
        ]));
        assert_eq!(cl.name.as_deref(), Some("vm1"));
        assert_eq!(cl.drives[0].id, "drive0");
        assert_eq!(cl.drives[0].backend, Backend::Threads);
        assert_eq!(cl.drives[1].id, "top");
        assert_eq!(cl.drives[1].backend, Backend::Native);
        assert_eq!(cl.drives[2].backend, Backend::IoUring);
    }

    #[test]
    fn decodes_accessors() {
        assert_eq!(
            decode_movzwl_rdi(&[0x0f, 0xb7, 0x47, 0x48, 0xc3, 0, 0, 0]),
            Some(0x48)
        );
        assert_eq!(
            decode_lea_rdi(&[0x48, 0x8d, 0x47, 0x68, 0xc3, 0, 0, 0]),
            Some(0x68)
        );
        assert_eq!(decode_lea_rdi(&[0x55, 0, 0, 0, 0, 0, 0, 0]), None);
    }

    #[test]
    fn reports_missing_symbols() {
        let all: HashSet<String> = PROBE_SYMBOLS.iter().map(|s| s.0.to_string()).collect();
        let mut info = BinaryInfo {
            version: Some("7.2.22".into()),
            symbols: all,
            layout: None,
            layout_note: String::new(),
        };
        assert!(info.missing(true).is_empty());
        info.symbols.remove("blk_aio_flush");
        info.symbols.remove("virtqueue_pop");
        assert_eq!(
            info.missing(false),
            vec![("blk_aio_flush", "h.submit and host I/O of flushes")]
        );
        assert_eq!(info.missing(true).len(), 2);
    }

    #[test]
    fn finds_version() {
        let d = b"xx\0QEMU emulator version 7.2.22 (Debian 1:7.2)\nCopyright";
        assert_eq!(find_version(d).as_deref(), Some("7.2.22"));
        assert_eq!(find_version(b"nothing"), None);
    }
}
