//! QEMU's private structure layouts per release, keyed on the full version
//! (7.2 stable point releases differ), and the choice of a layout for a binary.
//!
//! Sources: the QEMU trees and Debian/Ubuntu binaries listed in
//! shared/compat-facts.md (offsets built with gdb, binaries disassembled).

use std::fmt;

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
    /// VirtIOBlockReq.acct.start_time_ns (h.submit without blk_aio_* probes).
    pub req_acct_start: u32,
    pub qiov_size: u32,
    /// LuringAIOCB.sqeq (the SQE copy); None from 10.2 (LuringRequest, no copy).
    pub luring_sqe: Option<u32>,
    /// VirtIOBlock.blk (BlockBackend *); BlockBackend.name (the drive id).
    pub vblk_blk: u32,
    pub blk_name: u32,
}

/// One field of [`Layout`]: key (for overrides), C name (for messages).
pub struct Field {
    pub key: &'static str,
    pub c_name: &'static str,
    get: fn(&Layout) -> Option<u32>,
    set: fn(&mut Layout, u32),
}

impl Field {
    pub fn get(&self, l: &Layout) -> Option<u32> {
        (self.get)(l)
    }
}

macro_rules! fields {
    ($($f:ident => $c:expr),* $(,)?) => {
        /// Every field of [`Layout`] except `luring_sqe` (see [`LURING_FIELD`]).
        pub const FIELDS: &[Field] = &[$(Field {
            key: stringify!($f),
            c_name: $c,
            get: |l| Some(l.$f),
            set: |l, v| l.$f = v,
        }),*];
    };
}

fields! {
    vq_queue_index => "VirtQueue.queue_index",
    vq_guest_notifier => "VirtQueue.guest_notifier",
    vq_host_notifier => "VirtQueue.host_notifier",
    vq_vdev => "VirtQueue.vdev",
    elem_index => "VirtQueueElement.index",
    elem_out_num => "VirtQueueElement.out_num",
    elem_in_num => "VirtQueueElement.in_num",
    elem_in_sg => "VirtQueueElement.in_sg",
    elem_out_sg => "VirtQueueElement.out_sg",
    req_dev => "VirtIOBlockReq.dev",
    req_vq => "VirtIOBlockReq.vq",
    req_in => "VirtIOBlockReq.in",
    req_out => "VirtIOBlockReq.out",
    req_qiov_size => "VirtIOBlockReq.qiov.size",
    req_mr_next => "VirtIOBlockReq.mr_next",
    req_acct_start => "VirtIOBlockReq.acct.start_time_ns",
    qiov_size => "QEMUIOVector.size",
    vblk_blk => "VirtIOBlock.blk",
    blk_name => "BlockBackend.name",
}

pub const LURING_FIELD: Field = Field {
    key: "luring_sqe",
    c_name: "LuringAIOCB.sqeq",
    get: |l| l.luring_sqe,
    set: |l, v| l.luring_sqe = Some(v),
};

/// A field by key, or by C name.
pub fn field(key: &str) -> Option<&'static Field> {
    FIELDS
        .iter()
        .chain(std::iter::once(&LURING_FIELD))
        .find(|f| f.key == key || f.c_name == key)
}

/// QEMU 7.2.6+ (Debian 12's 7.2.22); the other releases differ from it only as
/// the table below says. Constant 6.2–10.2: VirtQueueElement, VirtIOBlockReq,
/// QEMUIOVector, BlockBackend.name.
const BASE: Layout = Layout {
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
    elem_out_num: 0xc,
    elem_in_num: 0x10,
    elem_in_sg: 0x28,
    elem_out_sg: 0x30,
    // struct VirtIOBlockReq: elem (56), sector_num, dev, vq (0x48), inhdr_undo,
    // outhdr_undo, in (0x80), out (0x88), qiov (0x98, 40), in_len, next, mr_next,
    // acct (BlockAcctCookie { bytes, start_time_ns, type }).
    req_dev: 0x40,
    req_vq: 0x48,
    req_in: 0x80,
    req_out: 0x88,
    req_qiov_size: 0x98 + 0x20,
    req_mr_next: 0xd0,
    req_acct_start: 0xd8 + 8,
    // QEMUIOVector { iov; niov; union { { nalloc; local_iov }, { pad; size } } }
    qiov_size: 0x20,
    // struct LuringAIOCB: Coroutine *co; struct io_uring_sqe sqeq; …
    luring_sqe: Some(8),
    // struct VirtIOBlock { VirtIODevice parent_obj; BlockBackend *blk; … }
    vblk_blk: 0x200,
    // struct BlockBackend { char *name; … } (blk_name())
    blk_name: 0,
};

const fn with_blk(blk: u32) -> Layout {
    let mut l = BASE;
    l.vblk_blk = blk;
    l
}

const L6_2: Layout = {
    let mut l = with_blk(0x1d8);
    l.vq_vdev = 0x68;
    l.vq_guest_notifier = 0x70;
    l.vq_host_notifier = 0x7c;
    l
};

const L10_2: Layout = {
    let mut l = with_blk(0x218);
    l.luring_sqe = None;
    l
};

const L11: Layout = {
    let mut l = L10_2;
    l.vblk_blk = 0x228;
    l
};

/// A QEMU version `major.minor.micro`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u16, pub u16, pub u16);

impl Version {
    /// "7.2.22", "10.0.2", "9.2.0", "8.2.2 (Debian …)" → version; the micro part
    /// may be missing ("11.1" → 11.1.0).
    pub fn parse(s: &str) -> Option<Version> {
        let head = s
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .next()?;
        let mut it = head.split('.');
        let a = it.next()?.parse().ok()?;
        let b = it.next()?.parse().ok()?;
        let c = it.next().and_then(|x| x.parse().ok()).unwrap_or(0);
        Some(Version(a, b, c))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// One row: versions `from..=to` share `layout`.
pub struct Release {
    pub from: Version,
    pub to: Version,
    pub name: &'static str,
    pub layout: Layout,
    /// Whether every offset of the row was measured (false: inferred).
    pub measured: bool,
}

const fn rel(from: Version, to: Version, name: &'static str, layout: Layout) -> Release {
    Release {
        from,
        to,
        name,
        layout,
        measured: true,
    }
}

const END: u16 = u16::MAX;

/// Releases in version order. 11.x: 10.2's layout but VirtIOBlock.blk at 0x228, as
/// the 11.1.3 binary's virtio-blk code uses it (`mov 0x228(%r12),%rdi; call blk_*`)
/// and its accessors show for VirtQueue; the rest is not from a measured tree (the
/// runtime check decides).
pub const RELEASES: &[Release] = &[
    rel(Version(6, 2, 0), Version(6, 2, END), "6.2", L6_2),
    rel(
        Version(7, 2, 0),
        Version(7, 2, 4),
        "7.2.0-7.2.4",
        with_blk(0x1f0),
    ),
    rel(Version(7, 2, 5), Version(7, 2, 5), "7.2.5", with_blk(0x1f8)),
    rel(Version(7, 2, 6), Version(7, 2, END), "7.2.6+", BASE),
    // The sources give 0x200 for 8.0 with a doubt; 8.0 has the accessor that
    // confirms it (virtio_config_get_guest_notifier).
    Release {
        measured: false,
        ..rel(Version(8, 0, 0), Version(8, 0, END), "8.0", with_blk(0x200))
    },
    rel(
        Version(8, 1, 0),
        Version(9, 2, END),
        "8.1-9.2",
        with_blk(0x208),
    ),
    rel(
        Version(10, 0, 0),
        Version(10, 1, END),
        "10.0-10.1",
        with_blk(0x200),
    ),
    rel(Version(10, 2, 0), Version(10, 2, END), "10.2", L10_2),
    Release {
        measured: false,
        ..rel(Version(11, 0, 0), Version(11, END, END), "11.x", L11)
    },
];

/// How the table answered for a version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Basis {
    /// The version is in a release row.
    Known {
        release: &'static str,
        measured: bool,
    },
    /// Not in the table (a gap, or newer/older than every row): the nearest older
    /// release's layout (or the oldest one for versions before it) is tried.
    Nearest { release: &'static str },
    /// The version could not be read from the binary: the newest layout is tried.
    NoVersion { release: &'static str },
}

impl Basis {
    /// Whether the table's values for the fields no code confirms can be trusted.
    pub fn trusted(&self) -> bool {
        matches!(self, Basis::Known { measured: true, .. })
    }
}

impl fmt::Display for Basis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Basis::Known {
                release,
                measured: true,
            } => write!(f, "layout of QEMU {release}"),
            Basis::Known {
                release,
                measured: false,
            } => write!(f, "layout of QEMU {release} (not measured on this release)"),
            Basis::Nearest { release } => {
                write!(f, "no layout for this version: trying QEMU {release}'s")
            }
            Basis::NoVersion { release } => {
                write!(f, "version unknown: trying QEMU {release}'s layout")
            }
        }
    }
}

/// The layout to use for a version.
pub fn select(version: Option<Version>) -> (Layout, Basis) {
    let newest = &RELEASES[RELEASES.len() - 1];
    let Some(v) = version else {
        return (
            newest.layout,
            Basis::NoVersion {
                release: newest.name,
            },
        );
    };
    if let Some(r) = RELEASES.iter().find(|r| r.from <= v && v <= r.to) {
        return (
            r.layout,
            Basis::Known {
                release: r.name,
                measured: r.measured,
            },
        );
    }
    let r = RELEASES
        .iter()
        .rev()
        .find(|r| r.to < v)
        .unwrap_or(&RELEASES[0]);
    (r.layout, Basis::Nearest { release: r.name })
}

/// Parses `FIELD=VALUE[,FIELD=VALUE…]` (VALUE decimal or 0x-hex) and applies it.
pub fn apply_overrides(l: &mut Layout, spec: &str) -> Result<Vec<String>, String> {
    let mut done = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| format!("layout override {item:?}: expected FIELD=VALUE"))?;
        let f = field(k.trim()).ok_or_else(|| format!("layout override: no field {k:?}"))?;
        let v = v.trim();
        let val = match v.strip_prefix("0x") {
            Some(h) => u32::from_str_radix(h, 16),
            None => v.parse(),
        }
        .map_err(|e| format!("layout override {item:?}: {e}"))?;
        (f.set)(l, val);
        done.push(format!("{} = {val:#x}", f.c_name));
    }
    Ok(done)
}

/// Set a field by key (used by the code confirmations).
pub fn set_field(l: &mut Layout, f: &Field, v: u32) {
    (f.set)(l, v);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blk(v: &str) -> u32 {
        select(Version::parse(v)).0.vblk_blk
    }

    #[test]
    fn point_releases_of_7_2_differ() {
        assert_eq!(blk("7.2.0"), 0x1f0);
        assert_eq!(blk("7.2.4"), 0x1f0);
        assert_eq!(blk("7.2.5"), 0x1f8);
        assert_eq!(blk("7.2.6"), 0x200);
        assert_eq!(blk("7.2.22"), 0x200);
    }

    #[test]
    fn per_release_rows() {
        assert_eq!(blk("6.2.0"), 0x1d8);
        assert_eq!(select(Version::parse("6.2.0")).0.vq_vdev, 0x68);
        assert_eq!(blk("8.1.0"), 0x208);
        assert_eq!(blk("9.2.4"), 0x208);
        assert_eq!(blk("10.0.2"), 0x200);
        assert_eq!(blk("10.1.0"), 0x200);
        assert_eq!(blk("10.2.2"), 0x218);
        assert_eq!(select(Version::parse("10.2.0")).0.luring_sqe, None);
        assert_eq!(select(Version::parse("10.1.0")).0.luring_sqe, Some(8));
        let (l, b) = select(Version::parse("11.1.3"));
        assert_eq!((l.vblk_blk, b.trusted()), (0x228, false));
        assert!(select(Version::parse("7.2.22")).1.trusted());
    }

    #[test]
    fn gaps_and_unknown_versions() {
        // 7.0/7.1 are not in the table: nearest older release, untrusted.
        let (l, b) = select(Version::parse("7.1.0"));
        assert_eq!(b, Basis::Nearest { release: "6.2" });
        assert_eq!(l.vq_vdev, 0x68);
        // A future version: the newest layout.
        assert_eq!(
            select(Version::parse("12.0.0")).1,
            Basis::Nearest { release: "11.x" }
        );
        // Older than everything: the oldest.
        assert_eq!(
            select(Version::parse("5.2.0")).1,
            Basis::Nearest { release: "6.2" }
        );
        assert_eq!(select(None).1, Basis::NoVersion { release: "11.x" });
    }

    #[test]
    fn version_strings() {
        assert_eq!(Version::parse("7.2.22"), Some(Version(7, 2, 22)));
        assert_eq!(
            Version::parse("8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)"),
            Some(Version(8, 2, 2))
        );
        assert_eq!(Version::parse("11.1"), Some(Version(11, 1, 0)));
        assert_eq!(Version::parse("x"), None);
    }

    #[test]
    fn overrides() {
        let mut l = BASE;
        let done = apply_overrides(&mut l, "req_out=0x90, VirtQueue.vdev=104").unwrap();
        assert_eq!((l.req_out, l.vq_vdev), (0x90, 104));
        assert_eq!(done.len(), 2);
        assert!(apply_overrides(&mut l, "nope=1").is_err());
        assert!(apply_overrides(&mut l, "req_out").is_err());
        assert!(apply_overrides(&mut l, "req_out=zz").is_err());
        apply_overrides(&mut l, "luring_sqe=16").unwrap();
        assert_eq!(l.luring_sqe, Some(16));
    }
}
