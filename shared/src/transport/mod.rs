//! Channel between the agents.
//!
//! * [`guest`]: the guest agent's sender (std threads, no async runtime). It
//!   numbers every record it accepts, keeps it until the host acknowledges it
//!   (bounded; a full buffer refuses new records and counts them), resends the
//!   unacknowledged ones after a reconnection, answers host clock pings and
//!   issues its own probes. Writes are cut into pieces that every vsock backend
//!   carries in one descriptor.
//! * [`host`] (tokio, feature `host`): listens on AF_VSOCK and/or Unix socket
//!   paths (hybrid vsock: a guest connection to port P arrives on
//!   `<uds-path>_P`, see [`hybrid_vsock_path`]), serves many guests under
//!   per-VM budgets, verifies clock samples against its own timestamps, accounts
//!   for every record of every session, and hands events to the agent through
//!   one bounded inbox per connection.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::proto::{DEFAULT_VSOCK_PORT, HOST_CID};

#[cfg(any(test, feature = "testing"))]
pub mod faults;
pub mod guest;
#[cfg(feature = "host")]
pub mod host;
mod ring;
mod stream;

pub use guest::{local_cid, local_hello, GuestSender, GuestSenderConfig, SenderStats};

/// Where the guest agent sends its records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Vsock { cid: u32, port: u32 },
    Unix(PathBuf),
}

impl Default for Endpoint {
    fn default() -> Self {
        Endpoint::Vsock {
            cid: HOST_CID,
            port: DEFAULT_VSOCK_PORT,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// Parses `vsock:CID:PORT`, `vsock:PORT` (host CID 2), `vsock` (defaults),
/// `unix:PATH` or an absolute path.
impl FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err("empty unix socket path".into());
            }
            return Ok(Endpoint::Unix(PathBuf::from(p)));
        }
        if s.starts_with('/') {
            return Ok(Endpoint::Unix(PathBuf::from(s)));
        }
        let rest = if s == "vsock" {
            ""
        } else if let Some(r) = s.strip_prefix("vsock:") {
            r
        } else {
            return Err(format!(
                "bad endpoint {s:?}: want vsock[:CID]:PORT, unix:PATH or /PATH"
            ));
        };
        let num = |x: &str| {
            x.parse::<u32>()
                .map_err(|e| format!("bad number {x:?} in endpoint {s:?}: {e}"))
        };
        let parts: Vec<&str> = if rest.is_empty() {
            vec![]
        } else {
            rest.split(':').collect()
        };
        match parts.as_slice() {
            [] => Ok(Endpoint::default()),
            [port] => Ok(Endpoint::Vsock {
                cid: HOST_CID,
                port: num(port)?,
            }),
            [cid, port] => Ok(Endpoint::Vsock {
                cid: num(cid)?,
                port: num(port)?,
            }),
            _ => Err(format!("bad endpoint {s:?}")),
        }
    }
}

/// The Unix socket path on which a hybrid-vsock VMM (Firecracker, Cloud
/// Hypervisor, vhost-device-vsock) delivers guest connections to `port`.
pub fn hybrid_vsock_path(uds_path: &Path, port: u32) -> PathBuf {
    let mut s = uds_path.as_os_str().to_owned();
    s.push(format!("_{port}"));
    PathBuf::from(s)
}

/// One malloc arena for the whole agent, called before any other thread
/// exists. The agents' network threads free what their main threads allocate
/// (the guest's encoded records once acknowledged) or the other way round
/// (the host's decoded guest records after the join): with an arena per
/// thread, each keeps its own high-water mark of free pages. The threads
/// rarely allocate at the same moment, so sharing costs nothing.
pub fn one_heap_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets a tunable of glibc's allocator, before any other
    // thread exists; it touches no memory Rust owns.
    unsafe {
        nix::libc::mallopt(nix::libc::M_ARENA_MAX, 1);
    }
}

/// No transparent huge pages for the agent's memory. Where THP is `always`
/// (Debian's kernels), khugepaged may collapse part of the heap into a 2 MiB
/// page at any moment, and the agent's RSS jumps by up to 2 MiB of which it
/// uses a few KiB (seen in one guest agent of six in a bench run: 8.3 MiB
/// against 6.3). An error (a kernel without the prctl) changes nothing else.
pub fn no_huge_pages() -> Result<(), nix::Error> {
    nix::sys::prctl::set_thp_disable(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_takes_no_huge_pages_once_asked() {
        no_huge_pages().expect("PR_SET_THP_DISABLE");
        assert!(nix::sys::prctl::get_thp_disable().unwrap());
    }

    #[test]
    fn endpoint_parsing() {
        assert_eq!("vsock".parse::<Endpoint>().unwrap(), Endpoint::default());
        assert_eq!(
            "vsock:6000".parse::<Endpoint>().unwrap(),
            Endpoint::Vsock { cid: 2, port: 6000 }
        );
        assert_eq!(
            "vsock:3:7".parse::<Endpoint>().unwrap(),
            Endpoint::Vsock { cid: 3, port: 7 }
        );
        assert_eq!(
            "unix:/run/x.sock".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/run/x.sock".into())
        );
        assert_eq!(
            "/run/y".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/run/y".into())
        );
        assert!("tcp:1".parse::<Endpoint>().is_err());
        assert!("vsock:x".parse::<Endpoint>().is_err());
        assert!("vsock:1:2:3".parse::<Endpoint>().is_err());
        assert_eq!(Endpoint::default().to_string(), "vsock:2:5515");
        assert_eq!(
            hybrid_vsock_path(Path::new("/tmp/v.sock"), 5515),
            PathBuf::from("/tmp/v.sock_5515")
        );
    }
}
